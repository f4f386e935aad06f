"""The bus over TLS (``rediss://``) with an ACL user, against a real redis-server.

The server listens on TLS only, its default user is off and one ACL user has a
password; the certificates are made by the test (tests/security/certs.py).
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from star.bus import Bus, BusUnavailable, Subscriber, connect_redis
from star.settings import RedisSettings, SettingsError
from star.wire import Event, EventKind
from tests.conftest import bus_settings
from tests.security.certs import Pki, make_pki
from tests.security.tls_redis import PASSWORD, TlsRedisServer, redis_has_tls

WRONG = "Wrong-9d2e-Secret"


def tls_settings(server: TlsRedisServer, **kw: object) -> RedisSettings:
    defaults: dict[str, object] = {
        "url": server.url(),
        "tls_ca_file": str(server.pki.ca),
        "connect_timeout_s": 2.0,
        "socket_timeout_s": 5.0,
        "backoff_base_s": 0.05,
        "backoff_max_s": 0.2,
        "reconnect_timeout_s": 15.0,
    }
    defaults.update(kw)
    return RedisSettings(**defaults)  # type: ignore[arg-type]


async def test_publish_and_read_over_tls_with_an_acl_user(tls_redis: TlsRedisServer) -> None:
    bs = bus_settings()
    bus = Bus.from_settings(tls_settings(tls_redis), bs)
    try:
        sub = Subscriber(bus, "events", start="0")
        sent = Event(EventKind.WORKER_UP, time.time(), "decode-tls")
        await bus.publish("events", sent)
        entries = await sub.read(block_ms=1000)
        assert [e.msg for e in entries] == [sent]
        # The connection really is TLS, as the ACL user.
        assert await bus.redis.execute_command("ACL", "WHOAMI") == b"star"
        info = await bus.redis.client_info()
        assert info.get("user") == "star"
    finally:
        await bus.close()


async def test_username_and_password_settings_override_the_url(tls_redis: TlsRedisServer) -> None:
    url = f"rediss://127.0.0.1:{tls_redis.port}/0"
    r = connect_redis(tls_settings(tls_redis, url=url, username="star", password=PASSWORD))
    try:
        assert await r.ping()
    finally:
        await r.aclose()


async def test_wrong_password_fails_in_one_line_without_the_password(
    tls_redis: TlsRedisServer,
) -> None:
    # The default reconnect timeout (60 s): refused credentials fail at once, not
    # after a minute of retries.
    bus = Bus.from_settings(tls_settings(tls_redis, url=tls_redis.url(WRONG)), bus_settings())
    started = time.monotonic()
    try:
        with pytest.raises(BusUnavailable) as caught:
            await bus.publish("events", Event(EventKind.WORKER_UP, time.time(), "x"))
    finally:
        await bus.close()
    assert time.monotonic() - started < 10.0
    message = str(caught.value)
    assert "\n" not in message
    assert "invalid username-password pair" in message
    assert f"rediss://star:***@127.0.0.1:{tls_redis.port}/0" in message
    assert WRONG not in message and PASSWORD not in message


async def test_a_client_that_does_not_trust_the_ca_fails_clearly(
    tls_redis: TlsRedisServer, tmp_path: Path
) -> None:
    other = make_pki(tmp_path / "other", name="some-other-ca")
    for settings in (
        tls_settings(tls_redis, tls_ca_file=str(other.ca), reconnect_timeout_s=0.5),
        tls_settings(tls_redis, tls_ca_file="", reconnect_timeout_s=0.5),  # the system store
    ):
        bus = Bus.from_settings(settings, bus_settings())
        try:
            with pytest.raises(BusUnavailable) as caught:
                await bus.last_id("events")
        finally:
            await bus.close()
        message = str(caught.value)
        assert "\n" not in message
        assert "CERTIFICATE_VERIFY_FAILED" in message, message
        assert PASSWORD not in message


async def test_plain_redis_url_to_a_tls_port_fails_and_tls_files_need_rediss(
    tls_redis: TlsRedisServer,
) -> None:
    plain = f"redis://star:{PASSWORD}@127.0.0.1:{tls_redis.port}/0"
    with pytest.raises(
        SettingsError, match=r"redis.tls_ca_file set but redis.url .* is not rediss://"
    ) as caught:
        connect_redis(tls_settings(tls_redis, url=plain))
    assert PASSWORD not in str(caught.value)
    # Without the TLS files, a plain client gets no answer it can read from a TLS port.
    bus = Bus.from_settings(
        tls_settings(tls_redis, url=plain, tls_ca_file="", reconnect_timeout_s=0.5), bus_settings()
    )
    try:
        with pytest.raises(BusUnavailable) as unavailable:
            await bus.last_id("events")
    finally:
        await bus.close()
    assert PASSWORD not in str(unavailable.value)
    with pytest.raises(SettingsError, match="no such file"):
        connect_redis(tls_settings(tls_redis, tls_ca_file="/nonexistent/ca.pem"))


@pytest.fixture
def mutual_tls_redis(tmp_path: Path, pki: Pki) -> TlsRedisServer:
    if not redis_has_tls():
        pytest.skip("redis-server was built without TLS")
    server = TlsRedisServer(tmp_path, pki, auth_clients="yes")
    server.start()
    yield server  # type: ignore[misc]
    server.stop()


async def test_client_certificate_when_the_server_requires_one(
    mutual_tls_redis: TlsRedisServer,
) -> None:
    pki = mutual_tls_redis.pki
    with_cert = tls_settings(
        mutual_tls_redis, tls_cert_file=str(pki.client_cert), tls_key_file=str(pki.client_key)
    )
    bus = Bus.from_settings(with_cert, bus_settings())
    try:
        assert await bus.last_id("events") == "0-0"
    finally:
        await bus.close()
    bus = Bus.from_settings(tls_settings(mutual_tls_redis, reconnect_timeout_s=0.5), bus_settings())
    try:
        with pytest.raises(BusUnavailable):
            await bus.last_id("events")
    finally:
        await bus.close()


def test_star_up_takes_a_rediss_url_as_the_operators_redis(tls_redis: TlsRedisServer) -> None:
    """A plain PING to a TLS port gets no answer; `star up` must not start a private Redis then."""
    from star.fleet import redis_answers

    assert redis_answers(tls_redis.url())
    assert not redis_answers("redis://127.0.0.1:1/0")
