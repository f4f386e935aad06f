"""Signed bus entries: an HMAC-SHA256 tag beside each body (docs/design.md §4.2).

Sans-IO. The key is derived from ``cluster.secret`` (``HMAC(secret,
"star-bus/1")``); a tag covers the Redis key the entry is written to and the
exact body bytes, so an entry cannot be moved to another stream (a report
replayed as a decision) nor altered. Every process holding the secret signs
every kind: roles are not separated. Without a secret nothing is signed and
nothing is checked.
"""

from __future__ import annotations

import hmac
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

SIG = "sig"
"""The field (stream entry) beside ``body`` that carries the tag, in hex."""

LOAD_SIG = "~sig"
"""The ``<prefix>:load`` hash field with the tag of the whole view (no instance is named so)."""
DISPATCH_SIG = "~dispatch-sig"
"""The ``<prefix>:load`` hash field with the tag of ``<prefix>:dispatch``'s policy."""

UNSIGNED = "unsigned"
BAD_SIGNATURE = "bad_signature"

_LABEL = b"star-bus/1"


class Signer:
    """Signs and checks entries with the key derived from one cluster secret."""

    __slots__ = ("_key",)

    def __init__(self, secret: str) -> None:
        self._key = hmac.digest(secret.encode(), _LABEL, "sha256")

    def sign(self, name: str, body: bytes) -> str:
        """The tag of ``body`` written under Redis key ``name``."""
        return hmac.digest(self._key, name.encode() + b"\0" + body, "sha256").hex()

    def check(self, name: str, body: bytes, sig: bytes | str | None) -> str | None:
        """None if ``sig`` is ``body``'s tag under ``name``, else the reason it is refused."""
        if not sig:
            return UNSIGNED
        if isinstance(sig, bytes):
            try:
                sig = sig.decode("ascii")
            except UnicodeDecodeError:
                return BAD_SIGNATURE
        if not hmac.compare_digest(self.sign(name, body), sig):
            return BAD_SIGNATURE
        return None

    def sign_view(self, name: str, items: Iterable[tuple[bytes, bytes]]) -> str:
        """The tag of a whole hash (``<prefix>:load``): every field and value."""
        return self.sign(name, _view_bytes(items))

    def check_view(
        self, name: str, items: Iterable[tuple[bytes, bytes]], sig: bytes | str | None
    ) -> str | None:
        """:meth:`check` for a whole hash."""
        return self.check(name, _view_bytes(items), sig)


def _view_bytes(items: Iterable[tuple[bytes, bytes]]) -> bytes:
    """A hash's fields and values, length-prefixed in field order (unambiguous)."""
    parts: list[bytes] = []
    for field_name, value in sorted(items):
        parts += [len(field_name).to_bytes(4, "big"), field_name]
        parts += [len(value).to_bytes(4, "big"), value]
    return b"".join(parts)


@dataclass(slots=True)
class RefusalCounter:
    """Refused entries by reason, and when one earns a log line: each
    ``(key, reason)`` at most every ``every_s`` (a forger writing fast must not flood the log)."""

    every_s: float = 60.0
    total: dict[str, int] = field(default_factory=dict)
    _last: dict[tuple[str, str], float] = field(default_factory=dict)
    _pending: dict[tuple[str, str], int] = field(default_factory=dict)

    def refused(self, key: str, reason: str, now: float | None = None) -> int:
        """Count one refusal; how many (since the last line) to log now, 0: no line."""
        now = time.monotonic() if now is None else now
        self.total[reason] = self.total.get(reason, 0) + 1
        slot = (key, reason)
        self._pending[slot] = self._pending.get(slot, 0) + 1
        if now - self._last.get(slot, -self.every_s) < self.every_s:
            return 0
        self._last[slot] = now
        return self._pending.pop(slot)
