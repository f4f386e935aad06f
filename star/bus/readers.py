"""Reading the bus: :class:`GroupReader` (a consumer group, at-least-once) and
:class:`Subscriber` (one stream in order); both follow a stream through Redis
outages of any length when iterated."""

from __future__ import annotations

import asyncio
import collections
import hashlib
import time
from collections.abc import AsyncIterator
from typing import Any, TypeVar

import structlog
from redis.exceptions import ResponseError

from star.bus.connection import (
    TRANSIENT,
    BusUnavailable,
    Outage,
    as_str,
    first_stream_rows,
    xrevrange,
)
from star.bus.publish import Entry, Publisher
from star.wire import Message

log = structlog.get_logger(__name__)

M = TypeVar("M", bound=Message)


class GroupReader:
    """Consume a stream through a consumer group (at-least-once, explicit ack).

    Order of reads: this consumer's own pending entries (delivered before a
    crash or restart and never acknowledged), then entries idle longer than
    ``claim_idle_ms`` in other consumers' pending lists (``XAUTOCLAIM``), then
    new entries. Undecodable entries are dead-lettered and acknowledged so
    they are never delivered again. If the group vanished (a Redis restarted
    without persistence) it is created again.

    Nothing acknowledged is handed out twice, also across a failover: the
    bodies of the last :data:`ACKED_WINDOW` acknowledged entries are
    remembered, and an entry with one of them is acknowledged and dropped
    (``duplicate_entries_dropped``). A promoted replica can lack the old
    master's last acknowledgement (the entry comes back, pending or new) or
    its last entry (the publisher, whose reply the failover cut, adds it
    again under a new id): asynchronous replication.
    """

    def __init__(
        self,
        bus: Publisher,
        stream: str,
        group: str,
        consumer: str,
        expect: type[M] | tuple[type[M], ...] | None = None,
        start: str = "0",
    ) -> None:
        self.bus = bus
        self.key = bus.keys.stream(stream)
        self.group = group
        self.consumer = consumer
        self.expect = expect
        self.start = start
        self._backlog = True  # read our own pending entries first
        self._claim_cursor = "0-0"
        self._last_claim = 0.0
        self._group_ready = False
        self._delivered: dict[str, bytes] = {}  # entry id -> body digest, until acked
        self._acked: dict[bytes, None] = {}  # the digests acked last, oldest first

    async def _ensure_group(self) -> None:
        try:
            await self.bus.redis.xgroup_create(self.key, self.group, id=self.start, mkstream=True)
        except ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise
        self._group_ready = True

    async def read(self, block_ms: int | None = None) -> list[Entry]:
        """Next batch of entries (may be empty after ``block_ms``)."""
        return await self.bus.retrying(f"XREADGROUP {self.key}", lambda: self._read_once(block_ms))

    async def _read_once(self, block_ms: int | None) -> list[Entry]:
        return await self._accept(await self._read_raw(block_ms))

    async def _read_raw(self, block_ms: int | None) -> list[Any]:
        """Next batch of undecoded ``(id, fields)`` rows."""
        if not self._group_ready:
            await self._ensure_group()
        cfg = self.bus.settings
        try:
            if self._backlog:
                rows = await self.bus.redis.xreadgroup(
                    self.group, self.consumer, {self.key: "0"}, count=cfg.read_count
                )
                batch = first_stream_rows(rows)
                if batch:
                    return batch
                self._backlog = False
            now = time.monotonic()
            if now - self._last_claim >= cfg.claim_idle_ms / 4000:
                self._last_claim = now
                cursor, claimed, *_ = await self.bus.redis.xautoclaim(
                    self.key,
                    self.group,
                    self.consumer,
                    cfg.claim_idle_ms,
                    self._claim_cursor,
                    count=cfg.read_count,
                )
                self._claim_cursor = as_str(cursor)
                if claimed:
                    log.info("stale_entries_reclaimed", stream=self.key, count=len(claimed))
                    return list(claimed)
            rows = await self.bus.redis.xreadgroup(
                self.group,
                self.consumer,
                {self.key: ">"},
                count=cfg.read_count,
                block=self.bus.block_ms(block_ms),
            )
        except TRANSIENT:
            # After a reconnect our own pending entries come first again. (Before
            # ResponseError: READONLY, UNBLOCKED, OOM... are ResponseErrors too.)
            self._backlog = True
            raise
        except ResponseError as exc:
            if "NOGROUP" in str(exc):
                log.warning("consumer_group_recreated", stream=self.key, group=self.group)
                self._group_ready = False
                self._backlog = True
                return []
            raise
        return first_stream_rows(rows)

    async def _accept(self, batch: list[Any]) -> list[Entry]:
        """Decode a batch; bad entries are dead-lettered and acknowledged at
        once, entries acknowledged before (a failover's repeats) too."""
        fresh, repeated = [], []
        for row in batch:
            entry_id, raw = as_str(row[0]), row[1]
            digest = _digest(raw)
            if digest is not None and digest in self._acked:
                repeated.append(entry_id)
                continue
            fresh.append(row)
            if digest is not None:
                self._delivered[entry_id] = digest
        if repeated:
            log.info("duplicate_entries_dropped", stream=self.key, ids=repeated)
        good = await self.bus.decode_or_bury(self.key, fresh, self.expect)
        good_ids = {e.id for e in good}
        bad = [as_str(i) for i, _ in fresh if as_str(i) not in good_ids]
        if bad or repeated:
            await self.bus.redis.xack(self.key, self.group, *bad, *repeated)
        _keep_newest(self._delivered, ACKED_WINDOW)  # handed out, never acknowledged
        return good

    async def ack(self, *entry_ids: str) -> None:
        """Acknowledge processed entries (they are never delivered again)."""
        if entry_ids:
            await self.bus.retrying(
                f"XACK {self.key}", lambda: self.bus.redis.xack(self.key, self.group, *entry_ids)
            )
            for entry_id in entry_ids:
                digest = self._delivered.pop(entry_id, None)
                if digest is not None:
                    self._acked.setdefault(digest)
            _keep_newest(self._acked, ACKED_WINDOW)

    async def pending(self) -> int:
        """How many entries of the group are delivered but not acknowledged."""
        info = await self.bus.retrying(
            f"XPENDING {self.key}", lambda: self.bus.redis.xpending(self.key, self.group)
        )
        return int(info["pending"])

    async def __aiter__(self) -> AsyncIterator[list[Entry]]:
        """Non-empty batches for as long as the caller iterates, each acknowledged
        when the caller asks for the next one (so after it processed the batch).

        A Redis outage never ends the iteration (unlike :meth:`read`, which
        gives up after ``reconnect_timeout_s``): every attempt is logged by
        :meth:`~star.bus.connection.Connection.retrying` (``redis_unreachable_retrying``, at most once
        per ``backoff_max_s`` once the backoff has grown), the first
        :class:`BusUnavailable` of an outage once more (``stream_unreadable``),
        and reading goes on. Once Redis is back, an
        acknowledgement that could not be sent is sent first, then this
        consumer's pending entries are read before new ones: nothing
        delivered is lost and nothing acknowledged comes twice. A batch the
        caller breaks out of stays pending and is reclaimed after
        ``claim_idle_ms``. Cancelling the iterating task ends it.
        """
        async for entries in self.chunks(None):
            yield entries

    async def chunks(
        self, size: int | None, gate: asyncio.Event | None = None
    ) -> AsyncIterator[list[Entry]]:
        """As ``async for batch in reader``, but each batch is decoded and
        handed over ``size`` entries at a time (None: the whole batch), with a
        turn of the event loop before every chunk after a batch's first: a
        consumer of a busy stream never holds the loop for a whole batch
        (decoding a report costs ~0.1 ms, a batch up to ``bus.read_count`` of
        them), so the scheduler's ticks and lock renewals wait for one chunk
        at most.

        ``gate``: no chunk is decoded while it is clear (the scheduler closes
        it while a tick runs, so the tick's awaits do not each wait for a
        chunk of intake); entries wait, read and unacknowledged, meanwhile.
        """
        outage = self._outage()
        async for rows in self._raw_batches(outage):
            step = size or len(rows)
            for start in range(0, len(rows), step):
                if start:
                    await asyncio.sleep(0)
                if gate is not None and not gate.is_set():
                    await gate.wait()
                entries = await self._decode(rows[start : start + step], outage)
                if entries:
                    yield entries

    def _outage(self) -> Outage:
        return Outage(
            "stream_unreadable", "stream_readable_again", stream=self.key, group=self.group
        )

    async def _decode(self, rows: list[Any], outage: Outage) -> list[Entry]:
        """Decode rows; an undecodable one is dead-lettered, through outages."""
        while True:
            try:
                return await self.bus.retrying(
                    f"dead-letter {self.key}", lambda: self._accept(rows)
                )
            except BusUnavailable as exc:
                outage.down(exc)

    async def _raw_batches(self, outage: Outage) -> AsyncIterator[list[Any]]:
        """Non-empty undecoded batches, through outages; each acknowledged
        (every id, decodable or not) when the next one is asked for."""
        unacked: list[str] = []
        while True:
            try:
                if unacked:
                    await self.ack(*unacked)
                    unacked = []
                rows = await self.bus.retrying(
                    f"XREADGROUP {self.key}", lambda: self._read_raw(None)
                )
            except BusUnavailable as exc:
                outage.down(exc)
                continue
            outage.up()
            if rows:
                unacked = [as_str(i) for i, _ in rows]
                yield rows


class Subscriber:
    """Read one stream in order with plain ``XREAD``; never skips an entry.

    ``start`` is ``"$"`` (entries after the current last one — resolved to a
    concrete id on the first read, so entries published during a reconnect
    are not missed), ``"0"`` (from the beginning) or an entry id. Each read
    also asks for the stream's newest id (same round trip): if it is older
    than the last entry this subscriber read, Redis came back without the
    entries it had (restarted without persistence, or the key was deleted),
    and reading starts over from the beginning.

    ``async for entry in subscriber`` is the way to follow a stream for good:
    it outlives Redis outages of any length (see :meth:`__aiter__`).
    """

    def __init__(
        self,
        bus: Publisher,
        stream: str,
        expect: type[M] | tuple[type[M], ...] | None = None,
        start: str = "$",
    ) -> None:
        self.bus = bus
        self.key = bus.keys.stream(stream)
        self.expect = expect
        self.last_id = start
        # The newest id read from the stream itself; a caller's ``start`` may
        # lie past the stream's end (a time-based id) without meaning a reset.
        self._seen: str | None = None
        # Read but not yet handed out by __aiter__ (kept if the caller breaks).
        self._buffer: collections.deque[Entry] = collections.deque()

    async def read(self, block_ms: int | None = None) -> list[Entry]:
        """The next entries in stream order (may be empty after ``block_ms``).

        Raises :class:`BusUnavailable` once Redis has been unreachable for
        ``reconnect_timeout_s``; the next call resumes after the last entry
        returned.
        """
        return await self.bus.retrying(f"XREAD {self.key}", lambda: self._read_once(block_ms))

    async def _read_once(self, block_ms: int | None) -> list[Entry]:
        redis = self.bus.redis
        if self.last_id == "$":
            rows = await xrevrange(redis, self.key, 1)
            self.last_id = as_str(rows[0][0]) if rows else "0-0"
            self._seen = self.last_id if rows else None
        # Redis runs the two back to back: the newest id is the stream's as
        # this XREAD starts, whether or not a reconnect happened on the way
        # (redis-py reconnects an idle pooled connection silently).
        async with redis.pipeline(transaction=False) as pipe:
            pipe.xrevrange(self.key, count=1)
            pipe.xread(
                {self.key: self.last_id},
                count=self.bus.settings.read_count,
                block=self.bus.block_ms(block_ms),
            )
            newest_rows, reply = await pipe.execute()
        newest = as_str(newest_rows[0][0]) if newest_rows else "0-0"
        if self._seen is not None and _id_tuple(newest) < _id_tuple(self._seen):
            log.warning(
                "stream_went_back_rereading",
                stream=self.key,
                last_seen=self._seen,
                newest=newest,
            )
            self.last_id, self._seen = "0-0", None
            return await self._read_once(block_ms)
        batch = first_stream_rows(reply)
        # Decode (and dead-letter) before moving on: if Redis goes away while
        # a bad entry is buried, the whole batch is read again.
        entries = await self.bus.decode_or_bury(self.key, batch, self.expect)
        if batch:
            self.last_id = self._seen = as_str(batch[-1][0])
        return entries

    async def __aiter__(self) -> AsyncIterator[Entry]:
        """Every entry in stream order, for as long as the caller iterates.

        A Redis outage never ends the iteration: each ``reconnect_timeout_s``
        without Redis ends one :meth:`read` with :class:`BusUnavailable`, the
        first of an outage is logged (``stream_unreadable``) and
        reading goes on; once Redis is back it resumes after the last entry
        read (from the stream's start if Redis lost the stream). Entries read
        but not yet handed out survive a ``break``: iterating again yields
        them first. Cancelling the iterating task ends it.
        """
        outage = Outage("stream_unreadable", "stream_readable_again", stream=self.key)
        while True:
            while self._buffer:
                yield self._buffer.popleft()
            try:
                batch = await self.read()
            except BusUnavailable as exc:
                outage.down(exc)
                continue
            outage.up()
            self._buffer.extend(batch)


# Acknowledged bodies a GroupReader remembers: far more than a failover repeats
# (the publisher looks 64 entries back before adding again).
ACKED_WINDOW = 4096


def _keep_newest(d: dict[Any, Any], size: int) -> None:
    """Drop ``d``'s oldest entries (insertion order) beyond ``size``."""
    while len(d) > size:
        del d[next(iter(d))]


def _digest(raw: Any) -> bytes | None:
    """A digest of an entry's body (None: trimmed while pending, or no body)."""
    body = raw.get(b"body") if raw else None
    return hashlib.blake2b(body, digest_size=16).digest() if body else None


def _id_tuple(entry_id: str) -> tuple[int, int]:
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)
