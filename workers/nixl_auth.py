"""ZeroMQ CURVE on NIXL's side channel: only holders of the cluster secret get an agent's metadata.

vLLM's NIXL connector serves its agent metadata (which carries the UCX remote
keys to the registered KV memory) on a ZMQ ROUTER, ``VLLM_NIXL_SIDE_CHANNEL_
HOST/PORT``, to any peer that asks. With ``cluster.secret`` set
(:data:`SECRET_ENV` in the engine process's environment),
:func:`secure_nixl_side_channel` makes both ends of that channel CURVE
sockets: key pairs derived from the secret (:func:`curve_keys`), the
listener admitting only the cluster's client key (:class:`SideChannelGuard`).
A peer without the secret completes no handshake and gets nothing (logged as
``nixl_peer_refused``); a refused ``_nixl_handshake`` times out (5 s) as
against a dead peer. The server key comes from the secret too, so a client
also knows it reached its own cluster. With an empty secret vLLM's sockets
are left as they are.

What this does not give: the NIXL/UCX data path itself stays unencrypted.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import hmac
import importlib
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import structlog
import zmq
from zmq.utils import z85
from zmq.utils.monitor import parse_monitor_message

from star.settings import env_key

log = structlog.get_logger(__name__)

SECRET_ENV = env_key("cluster.secret")
"""The engine process's environment variable holding ``cluster.secret``."""

PATCHED_MODULES = (
    "vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_scheduler",  # the listener
    "vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_worker",  # the REQ client
)
"""vLLM modules that import ``zmq_ctx`` and open the side channel's sockets with it."""

ZAP_ENDPOINT = "inproc://zeromq.zap.01"  # fixed by ZAP (RFC 27)
ZAP_DOMAIN = "star-nixl"
MAX_LOGGED_PEERS = 1024
"""Refused peer addresses remembered (each logged once); past this they go unlogged."""

_SERVER_LABEL = b"star-nixl-side-channel/1 server\x00"
_CLIENT_LABEL = b"star-nixl-side-channel/1 client\x00"


@dataclass(frozen=True, slots=True)
class CurveKeys:
    """The cluster's two CURVE key pairs, z85-encoded (40 bytes each)."""

    server_public: bytes
    server_secret: bytes = field(repr=False)
    client_public: bytes
    client_secret: bytes = field(repr=False)


def curve_keys(secret: str) -> CurveKeys:
    """Deterministic key pairs of a ``cluster.secret``: the same on every engine of the cluster.

    Any 32 bytes are a Curve25519 secret key; each is an HMAC of the secret
    under its own label, so neither reveals the secret or the other key.
    """

    def secret_key(label: bytes) -> bytes:
        return z85.encode(hmac.new(secret.encode(), label, hashlib.sha256).digest())

    server, client = secret_key(_SERVER_LABEL), secret_key(_CLIENT_LABEL)
    return CurveKeys(zmq.curve_public(server), server, zmq.curve_public(client), client)


@dataclass(slots=True)
class RefusalLog:
    """When a refused peer earns a log line: each address once, each reason at most every minute.

    libzmq's monitor does not give a refused connection's address (its fd is
    closed before the event can be read), so those refusals are keyed by
    reason and summed; only the ZAP handler knows the address. A refused
    client also retries every ~100 ms, so one misconfigured peer would flood.
    """

    every_s: float = 60.0
    peers: set[str] = field(default_factory=set)
    last: dict[str, float] = field(default_factory=dict)
    pending: dict[str, int] = field(default_factory=dict)

    def refused(self, reason: str, peer: str | None, now: float) -> int:
        """How many refusals of ``reason`` (since its last line) to log now; 0: no line."""
        self.pending[reason] = self.pending.get(reason, 0) + 1
        if peer is not None:
            if peer in self.peers or len(self.peers) >= MAX_LOGGED_PEERS:
                return 0
            self.peers.add(peer)
        elif now - self.last.get(reason, -self.every_s) < self.every_s:
            return 0
        self.last[reason] = now
        return self.pending.pop(reason)


# A handshake the peer got wrong; not one it dropped (NO_DETAIL: a reset, a port scan) nor one
# ZAP refused (AUTH: logged by the handler, with the address).
_HANDSHAKE_FAILED = zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
_REASONS: dict[int, str] = {
    int(zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH): "no_curve",  # no cluster.secret, or not STAR
    int(zmq.PROTOCOL_ERROR_ZMTP_CRYPTOGRAPHIC): "wrong_key",  # another cluster.secret
}


class SideChannelGuard:
    """One thread answering ZAP for the listener's context and reading its socket monitor.

    ZAP admits the cluster's client key only. libzmq asks ZAP only once a
    client has proved it knows the server's key, which is the secret's too:
    a peer without the secret fails earlier, in the CURVE handshake, and is
    seen through the monitor. Both are logged as ``nixl_peer_refused``
    (:class:`RefusalLog`). The sockets are made by the caller and used by
    this thread only once it starts.
    """

    POLL_MS = 500  # how soon stop() is noticed; an idle guard wakes twice a second

    def __init__(
        self, zap: zmq.Socket[Any], monitor: zmq.Socket[Any], client_public: bytes
    ) -> None:
        self._zap, self._monitor = zap, monitor
        self._allowed = z85.decode(client_public)
        self._stop = threading.Event()
        self.log = RefusalLog()
        self._thread = threading.Thread(target=self._run, name="star_nixl_guard", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._zap, zmq.POLLIN)
        poller.register(self._monitor, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                ready = dict(poller.poll(self.POLL_MS))
                if self._zap in ready:
                    self._zap.send_multipart(self._zap_reply(self._zap.recv_multipart()))
                if self._monitor in ready:
                    event = parse_monitor_message(self._monitor.recv_multipart())
                    if event["event"] & _HANDSHAKE_FAILED:
                        self._refused(_REASONS.get(event["value"], "bad_handshake"), None)
        finally:
            self._zap.close(linger=0)
            self._monitor.close(linger=0)

    def _zap_reply(self, frames: list[bytes]) -> list[bytes]:
        # ZAP request: version, request id, domain, address, routing id, mechanism, credentials.
        version, request_id = frames[0], frames[1]
        mechanism = frames[5] if len(frames) > 5 else b""
        key = frames[6] if len(frames) > 6 else b""
        if mechanism == b"CURVE" and hmac.compare_digest(key, self._allowed):
            return [version, request_id, b"200", b"OK", b"", b""]
        address = frames[3].decode(errors="replace") if len(frames) > 3 else "?"
        self._refused("unknown_client_key", address)
        return [version, request_id, b"400", b"unknown client key", b"", b""]

    def _refused(self, reason: str, peer: str | None) -> None:
        count = self.log.refused(reason, peer, time.monotonic())
        if count:
            log.warning(
                "nixl_peer_refused",
                peer=peer or "unknown",
                reason=reason,
                refused=count,
                hint="a NIXL peer without this cluster's cluster.secret got no metadata",
            )


@contextlib.contextmanager
def curve_zmq_ctx(keys: CurveKeys, socket_type: Any, addr: str) -> Iterator[zmq.Socket[Any]]:
    """vLLM's NIXL ``zmq_ctx``, with CURVE set on the socket before it binds or connects.

    make_zmq_socket binds (ROUTER) or connects (REQ) before it returns, and
    CURVE must be set before either, so the options go in as the context's
    defaults, which pyzmq applies to each new socket.
    """
    from vllm.utils.network_utils import make_zmq_socket

    if socket_type not in (zmq.ROUTER, zmq.REQ):
        raise ValueError(f"Unexpected socket type: {socket_type}")
    ctx: zmq.Context[Any] = zmq.Context()
    guard: SideChannelGuard | None = None
    try:
        listener = socket_type == zmq.ROUTER
        if listener:
            zap = ctx.socket(zmq.REP)  # bound before the listener: no handshake without ZAP
            zap.linger = 0
            zap.bind(ZAP_ENDPOINT)
            ctx.setsockopt(zmq.CURVE_SERVER, 1)
            ctx.setsockopt(zmq.CURVE_SECRETKEY, keys.server_secret)
            ctx.setsockopt(zmq.ZAP_DOMAIN, ZAP_DOMAIN.encode())
        else:
            ctx.setsockopt(zmq.CURVE_SERVERKEY, keys.server_public)
            ctx.setsockopt(zmq.CURVE_PUBLICKEY, keys.client_public)
            ctx.setsockopt(zmq.CURVE_SECRETKEY, keys.client_secret)
        sock = make_zmq_socket(ctx=ctx, path=addr, socket_type=socket_type, bind=listener)
        ctx.sockopts.clear()
        # pyzmq ignores a default it cannot set: never serve the metadata unauthenticated.
        if sock.getsockopt(zmq.MECHANISM) != zmq.CURVE:
            raise RuntimeError("NIXL side channel: libzmq did not take the CURVE options")
        if listener:
            guard = SideChannelGuard(
                zap, sock.get_monitor_socket(_HANDSHAKE_FAILED), keys.client_public
            )
            guard.start()
        yield sock
    finally:
        if guard is not None:
            guard.stop()
        ctx.destroy(linger=0)


def secure_nixl_side_channel(secret: str) -> None:
    """Have vLLM's NIXL side channel use CURVE keys of ``secret`` (empty: vLLM's plain sockets).

    Replaces ``zmq_ctx`` in :data:`PATCHED_MODULES`, in this process, for
    sockets opened from now on; idempotent. Raises RuntimeError if vLLM no
    longer opens the channel through that name (rather than leave it open).
    """
    for name in PATCHED_MODULES:
        module = importlib.import_module(name)
        base: Callable[..., Any] | None = getattr(
            module, "_star_base_zmq_ctx", getattr(module, "zmq_ctx", None)
        )
        if base is None:
            raise RuntimeError(
                f"{name} has no zmq_ctx: cannot secure NIXL's side channel with this vLLM"
            )
        module._star_base_zmq_ctx = base  # type: ignore[attr-defined]
        if secret:
            module.zmq_ctx = functools.partial(curve_zmq_ctx, curve_keys(secret))  # type: ignore[attr-defined]
        else:
            module.zmq_ctx = base  # type: ignore[attr-defined]
