"""Signed bus entries: a tag beside each body, by role (docs/design.md §4.2).

Sans-IO. Four roles write to the bus: ``worker`` (reports, events),
``proxy`` (events), ``scheduler`` (decisions, the load view, the dispatch
policy, events) and ``operator`` (``star migrate``'s decisions; ``star
status`` and ``star inspect`` only read). A tag is ``<role>:<hex>`` over the
Redis key the entry is written to and the exact body bytes, so an entry
cannot be moved to another stream (a report replayed as a decision) nor
altered; a reader accepts each kind only from the roles allowed to write it
(:data:`ALLOWED`): a decision tagged by a worker is refused (``wrong_role``)
whatever its key.

Workers and proxies tag with HMAC-SHA256 (a report is checked in ~9 us, at
the scheduler's report rate); the scheduler and the operator sign with
Ed25519, whose public half is all a reader holds: a proxy or worker cannot
sign a decision, a load view or a policy. The keys come either from
``cluster.secret`` (every key derived from it, ``HMAC(secret,
"star-bus/2/<role>")``: every process can sign as every role, as ``star up``
runs) or from a keyring file (``cluster.keyring``, written per role by ``star
config keyring``): a role's file holds its own signing key and what it needs
to check the others (the HMAC keys of the roles it reads, the public keys of
the scheduler and the operator). Without either nothing is signed and nothing
is checked.
"""

from __future__ import annotations

import hmac
import json
import os
import secrets
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

from star.settings import SettingsError

SIG = "sig"
"""The field (stream entry) beside ``body`` that carries the tag, ``<role>:<hex>``."""

LOAD_SIG = "~sig"
"""The ``<prefix>:load`` hash field with the tag of the whole view (no instance is named so)."""
DISPATCH_SIG = "~dispatch-sig"
"""The ``<prefix>:load`` hash field with the tag of ``<prefix>:dispatch``'s policy."""

UNSIGNED = "unsigned"
BAD_SIGNATURE = "bad_signature"
WRONG_ROLE = "wrong_role"

ROLES = ("worker", "proxy", "scheduler", "operator")
SIGNED_BY_KEY = ("scheduler", "operator")
"""Roles that sign with Ed25519 (a reader holds only the public key)."""
ALL_ROLES = frozenset(ROLES)
ALLOWED: Mapping[str, frozenset[str]] = {
    "reports": frozenset({"worker"}),
    "decisions": frozenset({"scheduler", "operator"}),
    "load": frozenset({"scheduler"}),
    "dispatch": frozenset({"scheduler"}),
    "events": ALL_ROLES,
}
"""Who may write each kind (the last part of its Redis key); any other key: any role."""
_DEFAULT_ROLE = {"reports": "worker", "decisions": "scheduler", "load": "scheduler"}
_DEFAULT_ROLE |= {"dispatch": "scheduler", "events": "proxy"}

_LABEL = "star-bus/2/"
KEYRING_VERSION = 1

# What a role's keyring holds besides its own signing key: the HMAC keys of the
# roles whose entries it reads (and the public keys of every Ed25519 role).
_READS: Mapping[str, tuple[str, ...]] = {
    "worker": (),
    "proxy": ("worker", "proxy"),
    "scheduler": ("worker", "proxy"),
    "operator": ("worker", "proxy"),
}


class KeyringError(SettingsError):
    """A keyring file that cannot be used, or a role it holds no key of (a
    settings error: the commands print it as one line)."""


def _kind(name: str) -> str:
    return name.rsplit(":", 1)[-1]


def _derive(secret: bytes, role: str) -> bytes:
    return hmac.digest(secret, (_LABEL + role).encode(), "sha256")


@dataclass(frozen=True)
class Keyring:
    """The keys one process holds: HMAC keys by role, Ed25519 private and public keys by role."""

    role: str | None  # None: every role's keys (derived from cluster.secret)
    hmac_keys: Mapping[str, bytes]
    private: Mapping[str, Ed25519PrivateKey]
    public: Mapping[str, Ed25519PublicKey]

    @classmethod
    def from_secret(cls, secret: str | bytes) -> Keyring:
        """Every role's keys, derived from one secret (``cluster.secret``)."""
        root = secret.encode() if isinstance(secret, str) else secret
        hmac_keys = {r: _derive(root, r) for r in ROLES if r not in SIGNED_BY_KEY}
        private = {r: Ed25519PrivateKey.from_private_bytes(_derive(root, r)) for r in SIGNED_BY_KEY}
        public = {r: k.public_key() for r, k in private.items()}
        return cls(None, hmac_keys, private, public)

    def signs_as(self, role: str) -> bool:
        """Whether this keyring holds ``role``'s signing key."""
        return role in self.hmac_keys or role in self.private

    def for_role(self, role: str) -> Keyring:
        """What a process of ``role`` needs and no more (its file from ``star config keyring``)."""
        if role not in ROLES:
            raise KeyringError(f"unknown role {role!r}; roles are {', '.join(ROLES)}")
        wanted = {*_READS[role], role}
        return Keyring(
            role,
            {r: k for r, k in self.hmac_keys.items() if r in wanted},
            {r: k for r, k in self.private.items() if r == role},
            dict(self.public),
        )

    def to_json(self) -> str:
        raw = Encoding.Raw
        return json.dumps(
            {
                "star_keyring": KEYRING_VERSION,
                "role": self.role,
                "hmac": {r: k.hex() for r, k in sorted(self.hmac_keys.items())},
                "ed25519_private": {
                    r: k.private_bytes_raw().hex() for r, k in sorted(self.private.items())
                },
                "ed25519_public": {
                    r: k.public_bytes(raw, PublicFormat.Raw).hex()
                    for r, k in sorted(self.public.items())
                },
            },
            indent=2,
        )

    @classmethod
    def from_json(cls, text: str) -> Keyring:
        try:
            doc = json.loads(text)
            if doc.get("star_keyring") != KEYRING_VERSION:
                raise KeyringError(f"not a version-{KEYRING_VERSION} STAR keyring")
            role = doc["role"]
            if role not in ROLES:
                raise KeyringError(f"unknown role {role!r}")
            return cls(
                role,
                {r: bytes.fromhex(k) for r, k in doc["hmac"].items() if r in ROLES},
                {
                    r: Ed25519PrivateKey.from_private_bytes(bytes.fromhex(k))
                    for r, k in doc["ed25519_private"].items()
                    if r in SIGNED_BY_KEY
                },
                {
                    r: Ed25519PublicKey.from_public_bytes(bytes.fromhex(k))
                    for r, k in doc["ed25519_public"].items()
                    if r in SIGNED_BY_KEY
                },
            )
        except KeyringError:
            raise
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise KeyringError(f"unreadable keyring: {exc}") from None

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Keyring:
        try:
            return cls.from_json(Path(path).read_text())
        except OSError as exc:
            raise KeyringError(f"cannot read keyring {path}: {exc.strerror}") from None


def new_keyrings() -> dict[str, Keyring]:
    """One keyring per role from a fresh random root (which is not kept)."""
    full = Keyring.from_secret(secrets.token_bytes(32))
    return {r: full.for_role(r) for r in ROLES}


def bus_keys(secret: str, keyring: str) -> Keyring | None:
    """The bus's keys from ``cluster.keyring`` (a file) if set, else ``cluster.secret``."""
    if keyring:
        return Keyring.load(keyring)
    return Keyring.from_secret(secret) if secret else None


class Signer:
    """Signs entries as one role and checks them against who may write them."""

    __slots__ = ("_hmac", "_private", "_public", "keyring", "role")

    def __init__(self, secret: str | Keyring, role: str | None = None) -> None:
        self.keyring = secret if isinstance(secret, Keyring) else Keyring.from_secret(secret)
        if role is not None and role not in ROLES:
            raise KeyringError(f"unknown role {role!r}; roles are {', '.join(ROLES)}")
        self.role = role or self.keyring.role
        self._hmac = dict(self.keyring.hmac_keys)
        self._private = dict(self.keyring.private)
        self._public = dict(self.keyring.public)

    def signing_role(self, name: str) -> str:
        """The role this signer signs an entry under ``name`` as."""
        if self.role is not None:
            return self.role
        return _DEFAULT_ROLE.get(_kind(name), "operator")

    def sign(self, name: str, body: bytes) -> str:
        """The tag of ``body`` written under Redis key ``name``."""
        role = self.signing_role(name)
        data = name.encode() + b"\0" + body
        key = self._hmac.get(role)
        if key is not None:
            return f"{role}:{hmac.digest(key, data, 'sha256').hex()}"
        private = self._private.get(role)
        if private is None:
            raise KeyringError(f"this keyring holds no signing key for role {role!r}")
        return f"{role}:{private.sign(data).hex()}"

    def check(self, name: str, body: bytes, sig: bytes | str | None) -> str | None:
        """None if ``sig`` is ``body``'s tag under ``name`` by a role allowed to write
        it, else the reason it is refused."""
        if not sig:
            return UNSIGNED
        if isinstance(sig, bytes):
            try:
                sig = sig.decode("ascii")
            except UnicodeDecodeError:
                return BAD_SIGNATURE
        role, _, tag = sig.partition(":")
        if role not in ALLOWED.get(_kind(name), ALL_ROLES):
            return WRONG_ROLE if role in ROLES else BAD_SIGNATURE
        data = name.encode() + b"\0" + body
        key = self._hmac.get(role)
        if key is not None:
            return (
                None
                if hmac.compare_digest(hmac.digest(key, data, "sha256").hex(), tag)
                else BAD_SIGNATURE
            )
        public = self._public.get(role)
        if public is None:
            return BAD_SIGNATURE  # a role this keyring cannot check
        try:
            public.verify(bytes.fromhex(tag), data)
        except (InvalidSignature, ValueError):
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
