"""The Redis connection every role shares: the client factory, the keys of a
cluster, the errors, and the retry loop that waits out an outage."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Self, TypeVar, cast

import redis.asyncio as aioredis
import structlog
from redis._parsers.base import BaseParser
from redis.backoff import NoBackoff
from redis.exceptions import AuthenticationError, RedisError, ResponseError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.retry import Retry

from star.aio import raise_swallowed_cancel
from star.bus.signing import Keyring, KeyringError, RefusalCounter, Signer, bus_keys
from star.redis_sentinel import SentinelMaster, connect_master, describe
from star.redis_tls import tls_kwargs
from star.settings import BusSettings, RedisSettings, Settings

log = structlog.get_logger(__name__)

T = TypeVar("T")


class BusyError(ResponseError):
    """``BUSY``: a script or function has run past ``busy-reply-threshold``."""


class UnblockedError(ResponseError):
    """``UNBLOCKED``: a blocking command was ended because the server became a
    replica (or by ``CLIENT UNBLOCK ... ERROR``)."""


class NoReplicasError(ResponseError):
    """``NOREPLICAS``: a master with ``min-replicas-to-write`` has too few replicas
    in reach; under Sentinel, an old master whose replica was promoted
    (docs/operations.md, Redis Sentinel)."""


# Error replies that mean "no usable master right now", not "this command is
# wrong": a demoted master (READONLY, and UNBLOCKED for a blocked XREADGROUP
# when it turns replica), a replica cut off from its master (MASTERDOWN), a
# full Redis under noeviction (OOM), one loading its data set (LOADING), a
# slot in migration (TRYAGAIN), a long script (BUSY), a master cut off from
# its replicas under min-replicas-to-write (NOREPLICAS: under Sentinel, an
# old master whose replica was promoted). Each heals on its own or by a failover,
# so each is an outage like a refused connection: backed off, reconnected and
# given up on after reconnect_timeout_s exactly as one.
OUTAGE_REPLIES = (
    "READONLY", "UNBLOCKED", "MASTERDOWN", "OOM", "LOADING", "TRYAGAIN", "BUSY", "NOREPLICAS",
)  # fmt: skip

# Workaround: redis-py turns an error reply into an exception class by its
# first word (BaseParser.parse_error, which the pure-Python and the hiredis
# parsers, RESP2 and RESP3, all call) through the table
# BaseParser.EXCEPTION_CLASSES, and raises a bare ResponseError for a prefix it
# does not know. BUSY, UNBLOCKED and NOREPLICAS are not in it (redis-py 8.1), so STAR adds
# its own classes for them; only a whole first word matches, so BUSYGROUP and
# BUSYKEY stay plain ResponseErrors. The classes of all OUTAGE_REPLIES then go
# into TRANSIENT, the one tuple every retry loop and every "Redis is down"
# handler catches. Should redis-py map one of these prefixes itself one day,
# its class is kept (setdefault) and used.
_REPLY_CLASSES = BaseParser.EXCEPTION_CLASSES
_REPLY_CLASSES.setdefault("BUSY", BusyError)
_REPLY_CLASSES.setdefault("UNBLOCKED", UnblockedError)
_REPLY_CLASSES.setdefault("NOREPLICAS", NoReplicasError)


def _outage_class(prefix: str) -> type[RedisError]:
    cls = _REPLY_CLASSES.get(prefix)
    if not isinstance(cls, type) or not issubclass(cls, RedisError) or cls is ResponseError:
        raise RuntimeError(
            f"redis-py maps {prefix} error replies to {cls!r}, not a class of its own"
        )
    return cls


# What "Redis is not there right now" looks like: no connection, no answer in
# time, or one of OUTAGE_REPLIES (LOADING is redis-py's BusyLoadingError, a
# ConnectionError already).
TRANSIENT: tuple[type[BaseException], ...] = (
    RedisConnectionError,
    RedisTimeoutError,
    OSError,
    *dict.fromkeys(_outage_class(p) for p in OUTAGE_REPLIES),
)


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

    def down(self, exc: BaseException, **fields: Any) -> None:
        if self.since is None:
            self.since = time.monotonic()
            log.error(self.down_event, **self.context, **fields, error=str(exc) or repr(exc))

    def up(self) -> None:
        if self.since is not None:
            down_s = round(time.monotonic() - self.since, 3)
            log.info(self.up_event, **self.context, down_s=down_s)
            self.since = None


def connect_redis(settings: RedisSettings) -> aioredis.Redis:
    """The one Redis client factory: ``redis://``, ``rediss://`` or ``unix://``,
    or the master that ``redis.sentinels`` name (:mod:`star.redis_sentinel`).

    ``username``/``password`` from the settings override those in the URL.
    Responses are bytes (stream bodies are msgpack).
    """
    common: dict[str, Any] = {
        "socket_connect_timeout": settings.connect_timeout_s,
        "socket_timeout": settings.socket_timeout_s,
        # No blind re-sends inside redis-py: a command whose connection broke
        # after Redis executed it would run twice (a duplicate XADD). Callers
        # retry through Connection.retrying, where publish() checks what landed.
        "retry": Retry(NoBackoff(), 0),
        "health_check_interval": 30,
        "decode_responses": False,
    }
    if settings.sentinels:
        return connect_master(settings, common, tls_kwargs(settings), TRANSIENT)
    kwargs = dict(common)
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


class Connection:
    """One Redis client with the bus settings, and the retry loop every call goes through."""

    def __init__(
        self,
        redis: aioredis.Redis,
        settings: BusSettings,
        redis_settings: RedisSettings,
        secret: str | Keyring | None = "",
        role: str | None = None,
    ) -> None:
        self.redis = redis
        self.settings = settings
        self.redis_settings = redis_settings
        # With cluster.secret (or a keyring) every entry written is signed, as
        # ``role`` (None: the role that writes each kind), and every entry read
        # must be, by a role allowed to write it (star.bus.signing); without either neither.
        self.signer = Signer(secret, role) if secret else None
        self.refusals = RefusalCounter()
        self.keys = Keys(settings.prefix)
        self._maxlen = {
            self.keys.reports: settings.maxlen_reports,
            self.keys.decisions: settings.maxlen_decisions,
            self.keys.events: settings.maxlen_events,
            self.keys.dead: settings.maxlen_dead,
        }

    @classmethod
    def from_settings(
        cls,
        redis_settings: RedisSettings,
        bus_settings: BusSettings,
        secret: str | Keyring | None = "",
        role: str | None = None,
    ) -> Self:
        """A connection for one cluster; ``secret`` is ``cluster.secret`` or a keyring
        (signing, see :meth:`for_cluster`), ``role`` what it signs as."""
        return cls(connect_redis(redis_settings), bus_settings, redis_settings, secret, role)

    @classmethod
    def for_cluster(cls, settings: Settings, role: str) -> Self:
        """A process's connection: its settings' Redis and bus, signing as ``role``
        with ``cluster.keyring`` if set, else with keys derived from ``cluster.secret``."""
        keys = bus_keys(settings.cluster.secret, settings.cluster.keyring)
        if keys is not None and role != "operator" and not keys.signs_as(role):
            # A service that would fail at its first write fails now (an operator's
            # read-only command may read with any role's file).
            raise KeyringError(
                f"cluster.keyring {settings.cluster.keyring} is a {keys.role}'s: it cannot "
                f"sign as the {role} (give this process its role's file from star config keyring)"
            )
        return cls.from_settings(settings.redis, settings.bus, keys, role)

    async def close(self) -> None:
        await self.redis.aclose()

    async def retrying(self, what: str, op: Callable[[], Awaitable[T]]) -> T:
        """Run ``op`` until it succeeds, backing off while Redis is unreachable
        or answers as no usable master (:data:`OUTAGE_REPLIES`).

        Delays double from ``backoff_base_s`` up to ``backoff_max_s``; each
        failure is logged once; after ``reconnect_timeout_s`` without success
        :class:`BusUnavailable` is raised, and at once when Redis refuses the
        credentials.
        """
        if isinstance(self.redis, SentinelMaster):
            self.redis.follow()
        cfg = self.redis_settings
        delay = cfg.backoff_base_s
        started = time.monotonic()
        attempt = 0
        task = asyncio.current_task()
        cancels = task.cancelling() if task is not None else 0
        while True:
            try:
                result = await op()
            except AuthenticationError as exc:
                # Refused credentials do not heal by waiting (redis-py counts them
                # as a connection error): say so at once.
                raise BusUnavailable(
                    f"Redis at {describe(cfg)} refused the credentials during {what}: {exc} "
                    "(check redis.url, redis.username and redis.password)"
                ) from exc
            except TRANSIENT as exc:
                raise_swallowed_cancel(task, cancels)
                attempt += 1
                waited = time.monotonic() - started
                if waited >= cfg.reconnect_timeout_s:
                    raise BusUnavailable(
                        f"Redis at {describe(cfg)} unreachable for {waited:.1f}s during {what}: {exc}"
                    ) from exc
                log.warning(
                    "redis_unreachable_retrying",
                    op=what,
                    attempt=attempt,
                    delay_s=round(delay, 3),
                    error=str(exc),
                )
                if isinstance(exc, ResponseError):
                    # The server answered, as no usable master (OUTAGE_REPLIES):
                    # the next attempt dials again (resolving the host name
                    # again) instead of asking the same server on a pooled
                    # connection. Connections in use (a blocked read) stay.
                    await self.redis.connection_pool.disconnect(inuse_connections=False)
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
