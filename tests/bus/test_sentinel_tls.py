"""Redis Sentinel with TLS and an ACL user, as without Sentinel: a TLS-only
master with the default user off, and a TLS-only Sentinel that reaches it
with that user (``tests/security/tls_redis.py``'s server and certificates)."""

from __future__ import annotations

import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from star.bus import Bus, BusUnavailable, as_str, xrevrange
from star.ports import free_port
from star.redis_sentinel import SentinelMaster
from star.settings import RedisSettings
from tests.bus.sentinel_set import SERVICE
from tests.bus.test_subscriber_outage import decision
from tests.conftest import bus_settings
from tests.redis_server import launch, terminate
from tests.security.certs import Pki, make_pki
from tests.security.tls_redis import PASSWORD, USER, TlsRedisServer, redis_has_tls


class TlsSentinel:
    """``redis-server --sentinel`` on a TLS port only, monitoring ``master`` over TLS."""

    def __init__(self, workdir: Path, pki: Pki, master: TlsRedisServer) -> None:
        self.dir = workdir
        self.port = free_port()
        self.conf = workdir / "sentinel.conf"
        self.conf.write_text(
            "port 0\n"
            f"tls-port {self.port}\n"
            "bind 127.0.0.1\n"
            f"dir {workdir}\n"
            f"logfile {workdir / 'sentinel.log'}\n"
            f"tls-cert-file {pki.server_cert}\n"
            f"tls-key-file {pki.server_key}\n"
            f"tls-ca-cert-file {pki.ca}\n"
            "tls-auth-clients optional\n"
            "tls-replication yes\n"  # the Sentinel's own connections to the master: TLS
            f"sentinel monitor {SERVICE} 127.0.0.1 {master.port} 1\n"
            f"sentinel auth-user {SERVICE} {USER}\n"
            f"sentinel auth-pass {SERVICE} {PASSWORD}\n"
        )
        self.binary = master.binary
        self.pki = pki
        self.master = master
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        # The master's probe speaks TLS; the Sentinel answers PING alike.
        probe = TlsRedisServer(self.dir, self.pki)
        probe.port = self.port
        self.proc = launch(
            [self.binary, str(self.conf), "--sentinel"],
            self.dir / "sentinel.log",
            lambda: _tls_ping(probe),
        )

    def stop(self) -> None:
        if self.proc is not None:
            terminate(self.proc)
            self.proc = None


def _tls_ping(server: TlsRedisServer) -> bool:
    with socket.create_connection(("127.0.0.1", server.port), timeout=0.5) as raw:
        with server._client_tls.wrap_socket(raw, server_hostname="127.0.0.1") as sock:
            sock.sendall(b"PING\r\n")
            return sock.recv(64).startswith(b"+PONG")


@pytest.fixture
def tls_sentinel(tmp_path: Path) -> Iterator[tuple[Pki, TlsSentinel]]:
    if not redis_has_tls():
        pytest.skip("redis-server was built without TLS")
    pki = make_pki(tmp_path / "pki")
    master = TlsRedisServer(tmp_path / "master", pki)
    (tmp_path / "master").mkdir()
    master.start()
    (tmp_path / "sentinel").mkdir()
    sentinel = TlsSentinel(tmp_path / "sentinel", pki, master)
    try:
        sentinel.start()
        yield pki, sentinel
    finally:
        sentinel.stop()
        master.stop()


async def test_a_tls_master_with_an_acl_user_through_a_tls_sentinel(
    tls_sentinel: tuple[Pki, TlsSentinel],
) -> None:
    pki, sentinel = tls_sentinel
    settings = RedisSettings(
        url="rediss://127.0.0.1:1/0",  # TLS to the master (and to a bare host:port Sentinel)
        username=USER,
        password=PASSWORD,
        tls_ca_file=str(pki.ca),
        tls_cert_file=str(pki.client_cert),
        tls_key_file=str(pki.client_key),
        sentinels=(f"127.0.0.1:{sentinel.port}",),
        service_name=SERVICE,
        connect_timeout_s=2.0,
        socket_timeout_s=2.0,
        backoff_base_s=0.05,
        backoff_max_s=0.2,
        reconnect_timeout_s=15.0,
    )
    bus = Bus.from_settings(settings, bus_settings())
    try:
        assert isinstance(bus.redis, SentinelMaster)
        entry = await bus.publish("decisions", decision(0))
        rows = await xrevrange(bus.redis, bus.keys.decisions, 5)
        assert [as_str(i) for i, _ in rows] == [entry]
        assert bus.redis.connection_pool.master_address == ("127.0.0.1", sentinel.master.port)  # type: ignore[attr-defined]
    finally:
        await bus.close()


async def test_an_untrusted_sentinel_certificate_is_refused(
    tls_sentinel: tuple[Pki, TlsSentinel],
) -> None:
    _pki, sentinel = tls_sentinel
    settings = RedisSettings(
        url="rediss://127.0.0.1:1/0",
        username=USER,
        password=PASSWORD,  # no tls_ca_file: the system's trust store, which lacks the test CA
        sentinels=(f"127.0.0.1:{sentinel.port}",),
        service_name=SERVICE,
        connect_timeout_s=1.0,
        backoff_base_s=0.02,
        backoff_max_s=0.05,
        reconnect_timeout_s=0.5,
    )
    bus = Bus.from_settings(settings, bus_settings())
    try:
        with pytest.raises(
            BusUnavailable, match=r"CERTIFICATE_VERIFY_FAILED|certificate verify failed"
        ):
            await bus.publish("decisions", decision(0))
    finally:
        await bus.close()
