"""Writing to the bus: publish without duplicates, dead-letter what cannot be decoded."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

import structlog

from star.bus.connection import Connection, RawRow, as_str, xrevrange
from star.bus.signing import SIG
from star.wire import Message, WireError, decode, encode

log = structlog.get_logger(__name__)

M = TypeVar("M", bound=Message)


@dataclass(frozen=True, slots=True)
class Entry:
    """One decoded stream entry."""

    id: str
    msg: Message
    fields: Mapping[str, str]


@dataclass(frozen=True, slots=True)
class DeadEntry:
    """An entry of the dead-letter stream: where it came from and why."""

    id: str
    stream: str
    original_id: str
    reason: str
    body: bytes


class Publisher(Connection):
    """Publishing and dead-lettering; decoding what readers read."""

    async def publish(self, stream: str, msg: Message, retry: bool = True) -> str:
        """XADD ``msg`` to ``stream`` (short name or key) with approximate trimming.

        Retried across reconnects without duplicates: before re-sending, the
        newest entries are checked for this exact body.
        """
        key = self.keys.stream(stream)
        fields = self.entry_fields(key, msg)
        body = fields["body"]
        attempted = False

        async def op() -> Any:
            nonlocal attempted
            if attempted:
                # The failed attempt may have reached Redis before the connection
                # broke; publishing again would duplicate the entry.
                for rid, raw in await xrevrange(self.redis, key, 64):
                    if raw.get(b"body") == body:
                        return rid
            attempted = True
            return await self.redis.xadd(key, fields, maxlen=self._maxlen[key], approximate=True)  # type: ignore[arg-type]

        entry_id = await self.retrying(f"XADD {key}", op) if retry else await op()
        return as_str(entry_id)

    def entry_fields(self, key: str, msg: Message) -> dict[str, bytes | str]:
        """The fields of ``msg``'s entry in stream ``key``: its summary, ``body`` and,
        with a secret, ``sig`` (every publisher, the leader's fenced script too)."""
        body = encode(msg)
        fields: dict[str, bytes | str] = {**msg.summary(), "body": body}
        if self.signer is not None:
            fields[SIG] = self.signer.sign(key, body)
        return fields

    def refused(self, key: str, reason: str, entry_id: str = "") -> None:
        """Count an entry refused for its signature; a log line per key and reason
        at most every minute, with how many since the last."""
        count = self.refusals.refused(key, reason)
        if count:
            log.warning(
                "bus_entry_refused",
                stream=key,
                reason=reason,
                refused=count,
                entry_id=entry_id,
                hint="written by something without this cluster.secret (or another one)",
            )

    def verified_body(self, key: str, raw: Mapping[bytes, bytes]) -> bytes | None:
        """An entry's body if its signature holds (or no secret is set), else None (counted)."""
        body = raw.get(b"body", b"")
        if self.signer is not None:
            reason = self.signer.check(key, body, raw.get(SIG.encode()))
            if reason is not None:
                self.refused(key, reason)
                return None
        return body

    def signed(
        self, stream: str, rows: list[tuple[str, dict[bytes, bytes]]]
    ) -> list[tuple[str, dict[bytes, bytes]]]:
        """The rows (``tail``, ``since``) whose signature holds; all without a secret."""
        if self.signer is None:
            return rows
        key = self.keys.stream(stream)
        return [(i, raw) for i, raw in rows if self.verified_body(key, raw) is not None]

    async def dead_letter(
        self, stream_key: str, entry_id: str, reason: str, body: bytes, quiet: bool = False
    ) -> None:
        """Move an undecodable (or unsigned) entry to ``<prefix>:dead`` (once per
        original entry); ``quiet``: the caller logs (rate-limited)."""
        mark = f"{self.keys.dead}:seen:{stream_key}:{entry_id}"

        async def op() -> None:
            # Several ordered subscribers may hit the same bad entry; only the
            # first copies it.
            if await self.redis.set(mark, b"1", nx=True, ex=24 * 3600):
                await self.redis.xadd(
                    self.keys.dead,
                    {"stream": stream_key, "id": entry_id, "reason": reason, "body": body},
                    maxlen=self.settings.maxlen_dead,
                    approximate=True,
                )

        await self.retrying(f"XADD {self.keys.dead}", op)
        if quiet:
            return
        log.warning(
            "entry_dead_lettered",
            stream=stream_key,
            entry_id=entry_id,
            reason=reason,
        )

    def decode_fields(
        self,
        key: str,
        entry_id: str,
        raw: Mapping[bytes, bytes],
        expect: type[M] | tuple[type[M], ...] | None,
    ) -> Entry:
        """Decode one entry's fields; raises :class:`WireError` (caller dead-letters).

        The signature is not checked here: :meth:`decode_or_bury` checks it first.
        """
        body = raw.get(b"body")
        if body is None:
            raise WireError("entry has no 'body' field")
        msg = decode(body, expect)
        text = {as_str(k): as_str(v) for k, v in raw.items() if k != b"body"}
        return Entry(entry_id, msg, text)

    async def decode_or_bury(self, key: str, entries: list[RawRow], expect: Any) -> list[Entry]:
        """Decode a batch; undecodable entries, and with a secret unsigned or
        badly signed ones, go to the dead-letter stream and are never returned."""
        out: list[Entry] = []
        signer = self.signer
        for raw_id, raw in entries:
            entry_id = as_str(raw_id)
            if raw is None:  # deleted (trimmed) while pending
                continue
            if signer is not None:
                body = raw.get(b"body", b"")
                reason = signer.check(key, body, raw.get(b"sig"))
                if reason is not None:
                    self.refused(key, reason, entry_id)
                    await self.dead_letter(key, entry_id, reason, body, quiet=True)
                    continue
            try:
                out.append(self.decode_fields(key, entry_id, raw, expect))
            except WireError as exc:
                await self.dead_letter(key, entry_id, str(exc), raw.get(b"body", b""))
        return out


def parse_dead(entry_id: str, raw: Mapping[bytes, bytes]) -> DeadEntry:
    """Read a dead-letter entry (plain fields, never fails)."""
    return DeadEntry(
        id=entry_id,
        stream=as_str(raw.get(b"stream", b"?")),
        original_id=as_str(raw.get(b"id", b"?")),
        reason=as_str(raw.get(b"reason", b"?")),
        body=raw.get(b"body", b""),
    )
