"""The bus as services use it: :class:`Bus` adds the queries (newest entries, a
time window, the dispatch view) to publishing."""

from __future__ import annotations

import time
from typing import Any, cast

import structlog

from star.bus.connection import as_str, xrevrange
from star.bus.publish import Publisher
from star.bus.signing import DISPATCH_SIG, LOAD_SIG
from star.wire import Event, LoadEntry, Report, WireError, decode, decode_as, encode

log = structlog.get_logger(__name__)


class Bus(Publisher):
    """Publishing, dead-lettering, retrying and the queries, over one Redis client."""

    async def last_id(self, stream: str) -> str:
        """The id of the newest entry of ``stream`` (``0-0`` if empty or absent)."""
        key = self.keys.stream(stream)

        async def op() -> Any:
            return await xrevrange(self.redis, key, 1)

        rows = await self.retrying(f"XREVRANGE {key}", op)
        return as_str(rows[0][0]) if rows else "0-0"

    async def tail(self, stream: str, count: int) -> list[tuple[str, dict[bytes, bytes]]]:
        """The last ``count`` raw entries of a stream, oldest first."""
        key = self.keys.stream(stream)
        rows = await self.retrying(f"XREVRANGE {key}", lambda: xrevrange(self.redis, key, count))
        return [(as_str(i), f) for i, f in reversed(rows)]

    async def since(self, stream: str, seconds: float) -> list[tuple[str, dict[bytes, bytes]]]:
        """The raw entries of a stream added in the last ``seconds`` (by entry id), oldest first.

        Entry ids are Redis's millisecond clock, so this is the time window a
        service reads (``start`` a window back), however busy the stream.
        """
        key = self.keys.stream(stream)
        start = f"{max(0, int((time.time() - seconds) * 1000))}-0"

        async def op() -> list[tuple[bytes, dict[bytes, bytes]]]:
            rows = await self.redis.xrange(key, min=start, max="+")
            return cast(list[tuple[bytes, dict[bytes, bytes]]], rows)

        return [(as_str(i), f) for i, f in await self.retrying(f"XRANGE {key}", op)]

    async def latest_reports(self, count: int = 4096) -> dict[str, Report]:
        """The newest report of each instance among the last ``count`` entries.

        Undecodable and (with a secret) unsigned entries are skipped (a consumer
        group dead-letters them).
        """
        latest: dict[str, Report] = {}
        key = self.keys.reports
        for _entry_id, raw in await self.tail("reports", count):
            body = self.verified_body(key, raw)
            if body is None:
                continue
            try:
                report = decode_as(body, Report)
            except WireError:
                continue
            latest[report.instance] = report
        return latest

    async def request_events(self, request: str, count: int = 20_000) -> list[Event]:
        """The events of ``request`` among the last ``count`` entries, oldest first.

        Undecodable and (with a secret) unsigned entries are skipped (a consumer
        group dead-letters them).
        """
        out: list[Event] = []
        key = self.keys.events
        for _entry_id, raw in await self.tail("events", count):
            body = self.verified_body(key, raw)
            if body is None:
                continue
            try:
                msg = decode(body)
            except WireError:
                continue
            if isinstance(msg, Event) and msg.request == request:
                out.append(msg)
        return out

    async def publish_load(self, entries: list[LoadEntry], ttl_s: float, policy: str = "") -> None:
        """Replace the ``<prefix>:load`` hash with the current dispatch view.

        ``policy``, the P->D dispatch policy the proxies are to apply to it, goes
        in ``<prefix>:dispatch`` (same transaction, same TTL): a key beside the
        hash, not a field in it, because readers decode every field of the hash
        as a :class:`LoadEntry` (an older proxy would warn on each read).

        With a secret, the hash also holds the tag of the whole view
        (``~sig``: no entry can be added, altered or removed) and of the policy
        (``~dispatch-sig``; the policy is read beside the hash, not atomically
        with it). An older proxy warns about those two fields on each read.
        """
        key = self.keys.load
        ttl_ms = max(1, int(ttl_s * 1000))
        view = {e.instance: encode(e) for e in entries}
        mapping: dict[str, bytes | str] = dict(view)
        if self.signer is not None:
            mapping[LOAD_SIG] = self.signer.sign_view(
                key, ((k.encode(), v) for k, v in view.items())
            )
            if policy:
                mapping[DISPATCH_SIG] = self.signer.sign(self.keys.dispatch, policy.encode())

        async def op() -> None:
            async with self.redis.pipeline(transaction=True) as pipe:
                pipe.delete(key)
                if mapping:
                    pipe.hset(key, mapping=mapping)  # type: ignore[arg-type]
                    pipe.pexpire(key, ttl_ms)
                if policy:
                    pipe.set(self.keys.dispatch, policy, px=ttl_ms)
                await pipe.execute()

        await self.retrying(f"HSET {key}", op)

    async def read_dispatch(self) -> tuple[dict[str, LoadEntry], str | None]:
        """The dispatch view and the policy published with it (None: none is)."""

        async def op() -> list[Any]:
            async with self.redis.pipeline(transaction=False) as pipe:
                pipe.hgetall(self.keys.load)
                pipe.get(self.keys.dispatch)
                return await pipe.execute()

        raw, policy = await self.retrying(f"HGETALL {self.keys.load}", op)
        raw = cast(dict[bytes, bytes], raw)
        if policy is not None and self.signer is not None:
            reason = self.signer.check(self.keys.dispatch, policy, raw.get(DISPATCH_SIG.encode()))
            if reason is not None:
                self.refused(self.keys.dispatch, reason)
                policy = None
        return self._load_entries(raw), (None if policy is None else as_str(policy))

    async def read_load(self) -> dict[str, LoadEntry]:
        """The dispatch view; bad values are skipped with a warning."""
        raw = cast(
            dict[bytes, bytes],
            await self.retrying(
                f"HGETALL {self.keys.load}", lambda: self.redis.hgetall(self.keys.load)
            ),
        )
        return self._load_entries(raw)

    def _load_entries(self, raw: dict[bytes, bytes]) -> dict[str, LoadEntry]:
        """Decode the ``<prefix>:load`` hash; bad values are skipped with a warning.

        With a secret, a view whose tag does not hold is refused whole (counted,
        a log line a minute): readers fall back as when no view is published.
        """
        view = {k: v for k, v in raw.items() if not k.startswith(b"~")}
        if self.signer is not None and raw:
            reason = self.signer.check_view(
                self.keys.load, view.items(), raw.get(LOAD_SIG.encode())
            )
            if reason is not None:
                self.refused(self.keys.load, reason)
                return {}
        return _decode_load(view)


def _decode_load(raw: dict[bytes, bytes]) -> dict[str, LoadEntry]:
    out: dict[str, LoadEntry] = {}
    for name, body in raw.items():
        try:
            out[as_str(name)] = decode_as(body, LoadEntry)
        except WireError as exc:
            log.warning("load_entry_skipped", instance=as_str(name), reason=str(exc))
    return out
