"""The event bus: Redis streams through redis-py's asyncio client (DESIGN §4).

* :func:`connect_redis` is the one connection factory (URL, ACL user/password,
  timeouts).
* :class:`Bus` publishes messages (``XADD ... MAXLEN ~``), each entry carrying
  the msgpack ``body`` next to a few plain-text fields so ``redis-cli XRANGE``
  is readable, and moves undecodable entries to ``<prefix>:dead``.
* :class:`GroupReader` consumes through a consumer group: its own pending
  entries first (after a crash), stale entries of dead consumers reclaimed with
  ``XAUTOCLAIM``, then new ones; the caller acknowledges what it processed
  (``async for batch in reader`` acknowledges each batch when it asks for the
  next, and follows the stream for good; the scheduler reads reports so).
* :class:`Subscriber` reads a stream in order with plain ``XREAD`` and never
  skips an entry, even across reconnects; ``async for entry in subscriber``
  follows it for good (proxies follow decisions and reports this way).

Readers survive a Redis restart: every call goes through :meth:`Bus.retrying`,
which retries with bounded, logged exponential backoff and gives up with
:class:`BusUnavailable` after ``redis.reconnect_timeout_s``; iterating a
:class:`Subscriber` or a :class:`GroupReader` logs that once per outage and
reads on.
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar, cast

import redis.asyncio as aioredis
import structlog
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.retry import Retry

from star.aio import raise_swallowed_cancel
from star.redact import redact_url
from star.redis_tls import tls_kwargs
from star.settings import BusSettings, RedisSettings
from star.wire import Event, LoadEntry, Message, Report, WireError, decode, decode_as, encode

log = structlog.get_logger(__name__)

T = TypeVar("T")
M = TypeVar("M", bound=Message)

# What "Redis is not there right now" looks like (BusyLoadingError, raised
# while a restarted server loads its AOF, is a ConnectionError).
TRANSIENT: tuple[type[BaseException], ...] = (RedisConnectionError, RedisTimeoutError, OSError)


class BusError(Exception):
    """Base of the bus adapter's errors."""


class BusUnavailable(BusError):
    """Redis stayed unreachable for longer than ``reconnect_timeout_s``."""


class Outage:
    """A loop's Redis outage, logged once when it starts and once when it ends.

    A loop that outlives outages calls :meth:`down` on each failure (every
    ``reconnect_timeout_s`` or every tick) and :meth:`up` on each success;
    only the first failure and the first success after it are logged,
    as ``down_event`` (error) and ``up_event`` (info, with ``down_s``).
    """

    def __init__(self, down_event: str, up_event: str, **context: Any) -> None:
        self.down_event = down_event
        self.up_event = up_event
        self.context = context
        self.since: float | None = None

    def down(self, exc: BaseException) -> None:
        if self.since is None:
            self.since = time.monotonic()
            log.error(self.down_event, **self.context, error=str(exc) or repr(exc))

    def up(self) -> None:
        if self.since is not None:
            down_s = round(time.monotonic() - self.since, 3)
            log.info(self.up_event, **self.context, down_s=down_s)
            self.since = None


def connect_redis(settings: RedisSettings) -> aioredis.Redis:
    """The one Redis client factory: ``redis://``, ``rediss://`` or ``unix://``.

    ``username``/``password`` from the settings override those in the URL.
    Responses are bytes (stream bodies are msgpack).
    """
    kwargs: dict[str, Any] = {
        "socket_connect_timeout": settings.connect_timeout_s,
        "socket_timeout": settings.socket_timeout_s,
        # No blind re-sends inside redis-py: a command whose connection broke
        # after Redis executed it would run twice (a duplicate XADD). Callers
        # retry through Bus.retrying, where publish() checks what landed.
        "retry": Retry(NoBackoff(), 0),
        "health_check_interval": 30,
        "decode_responses": False,
    }
    if settings.username:
        kwargs["username"] = settings.username
    if settings.password:
        kwargs["password"] = settings.password
    kwargs.update(tls_kwargs(settings))
    return aioredis.Redis.from_url(settings.url, **kwargs)


@dataclass(frozen=True, slots=True)
class Keys:
    """Redis keys of one cluster, all under ``prefix``."""

    prefix: str

    @property
    def reports(self) -> str:
        return f"{self.prefix}:reports"

    @property
    def decisions(self) -> str:
        return f"{self.prefix}:decisions"

    @property
    def events(self) -> str:
        return f"{self.prefix}:events"

    @property
    def dead(self) -> str:
        return f"{self.prefix}:dead"

    @property
    def load(self) -> str:
        return f"{self.prefix}:load"

    @property
    def dispatch(self) -> str:
        return f"{self.prefix}:dispatch"

    @property
    def leader(self) -> str:
        return f"{self.prefix}:leader"

    @property
    def fence(self) -> str:
        return f"{self.prefix}:fence"

    def stream(self, name: str) -> str:
        """A stream key from its short name (``reports``) or its full key."""
        if name in STREAMS:
            return f"{self.prefix}:{name}"
        if name.startswith(f"{self.prefix}:") and name.split(":", 1)[1] in STREAMS:
            return name
        raise BusError(f"unknown stream {name!r}; STAR streams are {', '.join(STREAMS)}")


STREAMS = ("reports", "decisions", "events", "dead")


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


def as_str(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


# redis-py types its replies as unions over ``decode_responses``; this bus always
# runs with it off, so replies are bytes. These helpers state that once.
RawRow = tuple[bytes, dict[bytes, bytes] | None]  # an entry; fields None if trimmed while pending


async def xrevrange(
    redis: aioredis.Redis, key: str, count: int
) -> list[tuple[bytes, dict[bytes, bytes]]]:
    """The newest ``count`` entries of ``key``, newest first."""
    return cast(list[tuple[bytes, dict[bytes, bytes]]], await redis.xrevrange(key, count=count))


def first_stream_rows(reply: Any) -> list[RawRow]:
    """The entries of the (single) stream in an XREAD / XREADGROUP reply."""
    return cast(list[RawRow], reply[0][1]) if reply else []


class Bus:
    """Publishing, dead-lettering and retrying over one Redis client."""

    def __init__(
        self, redis: aioredis.Redis, settings: BusSettings, redis_settings: RedisSettings
    ) -> None:
        self.redis = redis
        self.settings = settings
        self.redis_settings = redis_settings
        self.keys = Keys(settings.prefix)
        self._maxlen = {
            self.keys.reports: settings.maxlen_reports,
            self.keys.decisions: settings.maxlen_decisions,
            self.keys.events: settings.maxlen_events,
            self.keys.dead: settings.maxlen_dead,
        }

    @classmethod
    def from_settings(cls, redis_settings: RedisSettings, bus_settings: BusSettings) -> Bus:
        return cls(connect_redis(redis_settings), bus_settings, redis_settings)

    async def close(self) -> None:
        await self.redis.aclose()

    async def retrying(self, what: str, op: Callable[[], Awaitable[T]]) -> T:
        """Run ``op`` until it succeeds, backing off while Redis is unreachable.

        Delays double from ``backoff_base_s`` up to ``backoff_max_s``; each
        failure is logged once; after ``reconnect_timeout_s`` without success
        :class:`BusUnavailable` is raised.
        """
        cfg = self.redis_settings
        delay = cfg.backoff_base_s
        started = time.monotonic()
        attempt = 0
        task = asyncio.current_task()
        cancels = task.cancelling() if task is not None else 0
        while True:
            try:
                result = await op()
            except TRANSIENT as exc:
                raise_swallowed_cancel(task, cancels)
                attempt += 1
                waited = time.monotonic() - started
                if waited >= cfg.reconnect_timeout_s:
                    raise BusUnavailable(
                        f"Redis at {redact_url(cfg.url)} unreachable for {waited:.1f}s during {what}: {exc}"
                    ) from exc
                log.warning(
                    "redis_unreachable_retrying",
                    op=what,
                    attempt=attempt,
                    delay_s=round(delay, 3),
                    error=str(exc),
                )
                await asyncio.sleep(delay)
                delay = min(delay * 2, cfg.backoff_max_s)
                continue
            raise_swallowed_cancel(task, cancels)
            if attempt:
                log.info(
                    "redis_reachable_again",
                    op=what,
                    attempts=attempt,
                    down_s=round(time.monotonic() - started, 3),
                )
            return result

    def block_ms(self, requested: int | None = None) -> int:
        """How long one blocking read waits: ``requested`` (default ``bus.block_ms``).

        Capped at half of ``redis.socket_timeout_s``: redis-py applies the
        socket timeout to a blocking read's reply as well, so a longer block
        would end every idle read with a timeout (retried, and after
        ``reconnect_timeout_s`` a false :class:`BusUnavailable`). Never 0,
        which Redis takes as "block forever".
        """
        want = self.settings.block_ms if requested is None else requested
        return max(1, min(want, int(self.redis_settings.socket_timeout_s * 500)))

    # -- writing ------------------------------------------------------------

    async def publish(self, stream: str, msg: Message, retry: bool = True) -> str:
        """XADD ``msg`` to ``stream`` (short name or key) with approximate trimming.

        Retried across reconnects without duplicates: before re-sending, the
        newest entries are checked for this exact body.
        """
        key = self.keys.stream(stream)
        body = encode(msg)
        fields: dict[str, bytes | str] = {**msg.summary(), "body": body}
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

    async def dead_letter(self, stream_key: str, entry_id: str, reason: str, body: bytes) -> None:
        """Move an undecodable entry to ``<prefix>:dead`` (once per original entry)."""
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
        log.warning(
            "entry_dead_lettered",
            stream=stream_key,
            entry_id=entry_id,
            reason=reason,
        )

    # -- reading --------------------------------------------------------------

    def decode_fields(
        self,
        key: str,
        entry_id: str,
        raw: Mapping[bytes, bytes],
        expect: type[M] | tuple[type[M], ...] | None,
    ) -> Entry:
        """Decode one entry's fields; raises :class:`WireError` (caller dead-letters)."""
        body = raw.get(b"body")
        if body is None:
            raise WireError("entry has no 'body' field")
        msg = decode(body, expect)
        text = {as_str(k): as_str(v) for k, v in raw.items() if k != b"body"}
        return Entry(entry_id, msg, text)

    async def decode_or_bury(self, key: str, entries: list[RawRow], expect: Any) -> list[Entry]:
        """Decode a batch; undecodable entries go to the dead-letter stream."""
        out: list[Entry] = []
        for raw_id, raw in entries:
            entry_id = as_str(raw_id)
            if raw is None:  # deleted (trimmed) while pending
                continue
            try:
                out.append(self.decode_fields(key, entry_id, raw, expect))
            except WireError as exc:
                await self.dead_letter(key, entry_id, str(exc), raw.get(b"body", b""))
        return out

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

        Undecodable entries are skipped (a consumer group dead-letters them).
        """
        latest: dict[str, Report] = {}
        for _entry_id, raw in await self.tail("reports", count):
            try:
                report = decode_as(raw.get(b"body", b""), Report)
            except WireError:
                continue
            latest[report.instance] = report
        return latest

    async def request_events(self, request: str, count: int = 20_000) -> list[Event]:
        """The events of ``request`` among the last ``count`` entries, oldest first.

        Undecodable entries are skipped (a consumer group dead-letters them).
        """
        out: list[Event] = []
        for _entry_id, raw in await self.tail("events", count):
            try:
                msg = decode(raw.get(b"body", b""))
            except WireError:
                continue
            if isinstance(msg, Event) and msg.request == request:
                out.append(msg)
        return out

    # -- dispatch view (hash) ------------------------------------------------------

    async def publish_load(self, entries: list[LoadEntry], ttl_s: float, policy: str = "") -> None:
        """Replace the ``<prefix>:load`` hash with the current dispatch view.

        ``policy``, the P->D dispatch policy the proxies are to apply to it, goes
        in ``<prefix>:dispatch`` (same transaction, same TTL): a key beside the
        hash, not a field in it, because readers decode every field of the hash
        as a :class:`LoadEntry` (an older proxy would warn on each read).
        """
        key = self.keys.load
        ttl_ms = max(1, int(ttl_s * 1000))

        async def op() -> None:
            async with self.redis.pipeline(transaction=True) as pipe:
                pipe.delete(key)
                if entries:
                    pipe.hset(key, mapping={e.instance: encode(e) for e in entries})
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
        return _load_entries(cast(dict[bytes, bytes], raw)), (
            None if policy is None else as_str(policy)
        )

    async def read_load(self) -> dict[str, LoadEntry]:
        """The dispatch view; bad values are skipped with a warning."""
        raw = cast(
            dict[bytes, bytes],
            await self.retrying(
                f"HGETALL {self.keys.load}", lambda: self.redis.hgetall(self.keys.load)
            ),
        )
        return _load_entries(raw)


def _load_entries(raw: dict[bytes, bytes]) -> dict[str, LoadEntry]:
    """Decode the ``<prefix>:load`` hash; bad values are skipped with a warning."""
    out: dict[str, LoadEntry] = {}
    for name, body in raw.items():
        try:
            out[as_str(name)] = decode_as(body, LoadEntry)
        except WireError as exc:
            log.warning("load_entry_skipped", instance=as_str(name), reason=str(exc))
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


class GroupReader:
    """Consume a stream through a consumer group (at-least-once, explicit ack).

    Order of reads: this consumer's own pending entries (delivered before a
    crash or restart and never acknowledged), then entries idle longer than
    ``claim_idle_ms`` in other consumers' pending lists (``XAUTOCLAIM``), then
    new entries. Undecodable entries are dead-lettered and acknowledged so
    they are never delivered again. If the group vanished (a Redis restarted
    without persistence) it is created again.
    """

    def __init__(
        self,
        bus: Bus,
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
                    return await self._accept(batch)
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
                    return await self._accept(claimed)
            rows = await self.bus.redis.xreadgroup(
                self.group,
                self.consumer,
                {self.key: ">"},
                count=cfg.read_count,
                block=self.bus.block_ms(block_ms),
            )
        except ResponseError as exc:
            if "NOGROUP" in str(exc):
                log.warning("consumer_group_recreated", stream=self.key, group=self.group)
                self._group_ready = False
                self._backlog = True
                return []
            raise
        except TRANSIENT:
            # After a reconnect our own pending entries come first again.
            self._backlog = True
            raise
        return await self._accept(first_stream_rows(rows))

    async def _accept(self, batch: list[Any]) -> list[Entry]:
        """Decode a batch; bad entries are dead-lettered and acknowledged at once."""
        good = await self.bus.decode_or_bury(self.key, batch, self.expect)
        good_ids = {e.id for e in good}
        bad = [as_str(i) for i, _ in batch if as_str(i) not in good_ids]
        if bad:
            await self.bus.redis.xack(self.key, self.group, *bad)
        return good

    async def ack(self, *entry_ids: str) -> None:
        """Acknowledge processed entries (they are never delivered again)."""
        if entry_ids:
            await self.bus.retrying(
                f"XACK {self.key}", lambda: self.bus.redis.xack(self.key, self.group, *entry_ids)
            )

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
        :meth:`Bus.retrying` (``redis unreachable, retrying``, at most once
        per ``backoff_max_s`` once the backoff has grown), the first
        :class:`BusUnavailable` of an outage once more (``stream_unreadable``),
        and reading goes on. Once Redis is back, an
        acknowledgement that could not be sent is sent first, then this
        consumer's pending entries are read before new ones: nothing
        delivered is lost and nothing acknowledged comes twice. A batch the
        caller breaks out of stays pending and is reclaimed after
        ``claim_idle_ms``. Cancelling the iterating task ends it.
        """
        outage = Outage(
            "stream_unreadable", "stream_readable_again", stream=self.key, group=self.group
        )
        unacked: list[str] = []
        while True:
            try:
                if unacked:
                    await self.ack(*unacked)
                    unacked = []
                batch = await self.read()
            except BusUnavailable as exc:
                outage.down(exc)
                continue
            outage.up()
            if batch:
                unacked = [e.id for e in batch]
                yield batch


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
        bus: Bus,
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


def _id_tuple(entry_id: str) -> tuple[int, int]:
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)
