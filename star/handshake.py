"""Mutual authentication of the internal token protocol, without IO.

With a cluster secret (``cluster.secret``) a connection starts with three
frames before the worker's Hello::

    worker -> proxy   Challenge(nonce_w)
    proxy  -> worker  Answer(proof_p, nonce_p)   proof_p = HMAC(secret, PROXY  | nonce_w | nonce_p | address)
    worker -> proxy   Accept(proof_w)            proof_w = HMAC(secret, WORKER | nonce_w | nonce_p | address)
    worker -> proxy   Hello ...

``address`` is the worker's ``host:port`` as it reports it, which is what a
proxy dials: the proxy proves the secret for the address it dialled, the
worker for its own. So a relay that a proxy was sent to (a forged report, a
wrong address) and that forwards the frames to the real worker gets the
handshake refused on both sides: it cannot recompute the proofs for its own
address without the secret (issue 27 item 3).

Each side proves the secret over a nonce the other just drew, so a recorded
answer is useless on another connection, and the two proofs carry different
labels, so one side's proof cannot be reflected back as the other's. The
worker sends nothing but the Challenge until the proxy has proved itself (a
refused peer learns no instance, role or model), and the proxy sends no
request until the worker has proved itself (no prompt reaches an impostor).
Every frame after the Accept (the worker's Hello first) is sealed
(:class:`Channel`): AES-256-GCM under a key both sides derive from the
secret, both nonces and the address, with a per-direction frame counter as
the nonce. So someone on the path reads no prompt or token, and a frame
altered, dropped, replayed, reordered or injected fails authentication and
closes the connection (the proxy recovers its streams as from a dead peer).

:class:`WorkerHandshake` and :class:`ProxyHandshake` hold one side each:
frames in, frames out, :class:`HandshakeFailed` with a short reason.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import secrets
from dataclasses import dataclass, field
from typing import Literal

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from star.wire import Accept, Answer, Challenge, Message

NONCE_BYTES = 32
MAX_FRAME_BYTES = 256
"""The largest frame a worker reads before the peer has proved itself (an Answer is ~90)."""
TIMEOUT_S = 5.0
"""How long a worker waits for an Answer, and a proxy for Challenge to Hello."""

_PROXY = b"star-token-protocol/2 proxy\x00"
_WORKER = b"star-token-protocol/2 worker\x00"
_SESSION = b"star-token-protocol/2 session\x00"


class HandshakeFailed(Exception):
    """The peer did not prove the cluster secret; ``reason`` is one short word for logs."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(detail or reason)
        self.reason = reason


def secret_key(secret: str) -> bytes:
    """The HMAC key of a ``cluster.secret`` setting."""
    return secret.encode()


def proof(
    key: bytes, label: bytes, worker_nonce: bytes, proxy_nonce: bytes, address: str = ""
) -> bytes:
    """HMAC-SHA256 of the label, both nonces (fixed length) and the worker's address (last,
    so the input is unambiguous)."""
    data = label + worker_nonce + proxy_nonce + address.encode()
    return hmac.new(key, data, hashlib.sha256).digest()


def session_key(key: bytes, worker_nonce: bytes, proxy_nonce: bytes, address: str) -> bytes:
    """The connection's 32-byte channel key: only the two ends of this handshake know it."""
    return hmac.digest(key, _SESSION + worker_nonce + proxy_nonce + address.encode(), "sha256")


class ChannelBroken(Exception):
    """A sealed frame failed authentication: the connection must be closed."""


class Channel:
    """One connection's sealed frames, one side's view (sans IO).

    ``seal`` encrypts and authenticates a frame body for the peer, ``open``
    checks and decrypts one from it (:class:`ChannelBroken` if it fails).
    The nonce is the sender's side (4 bytes) and its frame count (8 bytes),
    so no nonce repeats under the key and a frame is accepted only in its
    place in the stream.
    """

    __slots__ = ("_aead", "_in", "_out", "_received", "_sent")

    def __init__(self, session: bytes, side: Literal["proxy", "worker"]) -> None:
        self._aead = AESGCM(session)
        proxy, worker = b"prxy", b"wrkr"
        self._out, self._in = (proxy, worker) if side == "proxy" else (worker, proxy)
        self._sent = 0
        self._received = 0

    def seal(self, body: bytes) -> bytes:
        nonce = self._out + self._sent.to_bytes(8, "big")
        self._sent += 1
        return self._aead.encrypt(nonce, body, None)

    def open(self, data: bytes) -> bytes:
        nonce = self._in + self._received.to_bytes(8, "big")
        try:
            body = self._aead.decrypt(nonce, data, None)
        except InvalidTag:
            raise ChannelBroken(
                f"frame {self._received} failed authentication "
                "(altered, replayed, reordered or not from the peer)"
            ) from None
        self._received += 1
        return body


def _nonce_ok(nonce: bytes) -> bool:
    return len(nonce) == NONCE_BYTES


@dataclass(slots=True)
class WorkerHandshake:
    """The worker's side: :meth:`challenge` first, then :meth:`answer` with the first frame read.

    ``address``: the ``host:port`` this worker reports (what proxies dial).
    """

    key: bytes
    address: str = ""
    nonce: bytes = field(default_factory=lambda: secrets.token_bytes(NONCE_BYTES))
    session: bytes = b""  # the channel key, once the proxy has proved itself

    def challenge(self) -> Challenge:
        return Challenge(self.nonce)

    def answer(self, msg: Message) -> Accept:
        """The Accept to send before Hello; raises :class:`HandshakeFailed`."""
        if not isinstance(msg, Answer):
            raise HandshakeFailed("unexpected_frame", f"expected an answer, got {msg.KIND!r}")
        if not _nonce_ok(msg.nonce):
            raise HandshakeFailed("bad_nonce", f"a nonce of {len(msg.nonce)} bytes")
        if msg.nonce == self.nonce:
            raise HandshakeFailed("reflected_nonce", "the answer echoes the challenge's nonce")
        expected = proof(self.key, _PROXY, self.nonce, msg.nonce, self.address)
        if not hmac.compare_digest(expected, msg.proof):
            raise HandshakeFailed(
                "bad_proof",
                f"the answer does not prove the cluster secret for {self.address or 'this worker'}",
            )
        self.session = session_key(self.key, self.nonce, msg.nonce, self.address)
        return Accept(proof(self.key, _WORKER, self.nonce, msg.nonce, self.address))


@dataclass(slots=True)
class ProxyHandshake:
    """The proxy's side: :meth:`on_challenge`, then :meth:`on_accept`; Hello may follow.

    ``address``: the ``host:port`` the proxy dialled.
    """

    key: bytes
    address: str = ""
    nonce: bytes = field(default_factory=lambda: secrets.token_bytes(NONCE_BYTES))
    worker_nonce: bytes = b""
    session: bytes = b""  # the channel key, once the worker has proved itself

    def on_challenge(self, msg: Message) -> Answer:
        """The Answer to send; raises :class:`HandshakeFailed` on anything but a Challenge."""
        if not isinstance(msg, Challenge):
            raise HandshakeFailed(
                "no_challenge",
                f"it sent {msg.KIND!r} before proving itself "
                "(a worker without cluster.secret, or an older STAR)",
            )
        if not _nonce_ok(msg.nonce) or msg.nonce == self.nonce:
            raise HandshakeFailed("bad_nonce", "its challenge is not a fresh nonce")
        self.worker_nonce = msg.nonce
        return Answer(proof(self.key, _PROXY, msg.nonce, self.nonce, self.address), self.nonce)

    def on_accept(self, msg: Message) -> None:
        """Check the worker's proof; raises :class:`HandshakeFailed`."""
        if not self.worker_nonce:
            raise HandshakeFailed("no_challenge", "an accept before any challenge")
        if not isinstance(msg, Accept):
            raise HandshakeFailed("unexpected_frame", f"expected an accept, got {msg.KIND!r}")
        expected = proof(self.key, _WORKER, self.worker_nonce, self.nonce, self.address)
        if not hmac.compare_digest(expected, msg.proof):
            raise HandshakeFailed("bad_proof", "it does not prove the cluster secret")
        self.session = session_key(self.key, self.worker_nonce, self.nonce, self.address)


def is_loopback(host: str) -> bool:
    """Whether binding ``host`` keeps a port on this machine (``localhost``, 127/8, ::1)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a host name: it may resolve to any interface
