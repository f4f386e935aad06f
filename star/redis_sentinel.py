"""Redis Sentinel: the ``redis.sentinels`` settings as redis-py's asyncio Sentinel client.

With ``redis.sentinels`` set, STAR asks those Sentinels for the address of the
master they monitor under ``redis.service_name`` and connects there; every new
connection asks again (redis-py's ``SentinelConnectionPool``), so after a
failover the bus's retry loop, which drops its connections on an outage,
reaches the promoted replica. An old master that takes writes without an
error is left too: :meth:`SentinelMaster.follow` asks the Sentinels every
:data:`FOLLOW_S` and moves the connections when they name another master. ``redis.url`` then gives only the master's scheme
(``rediss://`` = TLS with the ``redis.tls_*`` files), database and
credentials; its host and port are not used.

A sentinel is written ``host``, ``host:port`` (port 26379 if left out) or as a
URL, ``redis://[user:password@]host:port`` or ``rediss://...`` (TLS to the
Sentinel, with the same ``redis.tls_*`` files). A bare ``host:port`` is TLS
exactly when ``redis.url`` is ``rediss://``. ``redis.sentinel_password``
overrides a URL's password. redis-py connects to every Sentinel with one set
of options, so all of them must agree on TLS and credentials.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any, cast
from urllib.parse import urlsplit

import redis.asyncio as aioredis
import structlog
from redis.asyncio.connection import parse_url
from redis.asyncio.sentinel import (
    MasterNotFoundError,
    Sentinel,
    SentinelConnectionPool,
    SentinelManagedConnection,
    SentinelManagedSSLConnection,
)
from redis.exceptions import AuthenticationError, RedisError, ResponseError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from star.redact import redact_url
from star.settings import RedisSettings, SentinelAddress, SettingsError, parse_sentinel

log = structlog.get_logger(__name__)


def sentinel_addresses(settings: RedisSettings) -> list[SentinelAddress]:
    try:
        return [parse_sentinel(entry) for entry in settings.sentinels]
    except ValueError as exc:
        raise SettingsError(f"redis.sentinels: {exc}") from None


def describe(settings: RedisSettings) -> str:
    """Where the bus's Redis is, for messages: the URL, or the master's name and its Sentinels."""
    if not settings.sentinels:
        return redact_url(settings.url)
    sentinels = ", ".join(redact_url(entry) for entry in settings.sentinels)
    return f"master {settings.service_name!r} of Sentinels {sentinels}"


def _dropping(
    base: type[SentinelManagedConnection], outages: tuple[type[BaseException], ...]
) -> type[SentinelManagedConnection]:
    """``base`` that closes itself on an outage reply, so that its next command
    asks the Sentinels for the master again.

    redis-py's own connection does so for READONLY alone; NOREPLICAS (a master
    with ``min-replicas-to-write`` whose replica was promoted), UNBLOCKED,
    MASTERDOWN and the rest would keep a caller that does not go through
    :meth:`~star.bus.connection.Connection.retrying` (the scheduler's lock
    steps) on the old master until it is turned into a replica.
    """

    class Dropping(base):  # type: ignore[valid-type,misc]
        async def connect(self) -> None:
            # The pool calls this before every command it hands this connection:
            # one still on a master the pool no longer names (it was busy, a
            # blocked read say, when the master switched) is dropped here and
            # dials the one named now. Compared by address, not by who noticed:
            # redis-py's pool updates master_address itself whenever another
            # connection opens, and then the follower sees no change.
            named = getattr(self.connection_pool, "master_address", None)
            if self.is_connected and named is not None and (self.host, self.port) != tuple(named):
                await self.disconnect()
            await super().connect()

        async def read_response(self, *args: Any, **kwargs: Any) -> Any:
            try:
                return await super().read_response(*args, **kwargs)
            except outages:
                await self.disconnect()
                raise

    Dropping.__name__ = Dropping.__qualname__ = f"Dropping{base.__name__}"
    return Dropping


class Sentinels(Sentinel):
    """redis-py's Sentinel client, with errors a person can read.

    When no Sentinel names a master, redis-py's error lists each Sentinel
    client's whole ``repr`` and each error as ``auth:AuthenticationError``;
    this one says ``host:port: reason`` for each. When every Sentinel refuses
    the credentials it raises :class:`AuthenticationError`, which the bus
    reports at once (as a master refusing them), instead of retrying.
    """

    async def discover_master(self, service_name: str) -> tuple[str, int]:
        problems: list[str] = []
        refused = 0
        for sentinel in list(self.sentinels):
            kw = sentinel.connection_pool.connection_kwargs
            where = f"{kw.get('host')}:{kw.get('port')}"
            try:
                masters = cast(dict[str, dict[str, Any]], await sentinel.sentinel_masters())
            except AuthenticationError as exc:
                refused += 1
                problems.append(f"{where}: {exc}")
                continue
            except (RedisConnectionError, RedisTimeoutError, ResponseError) as exc:
                # An error reply too (NOPERM: its ACL user lacks SENTINEL MASTERS):
                # one Sentinel's, and the next may answer.
                problems.append(f"{where}: {exc}")
                continue
            state = masters.get(service_name)
            if state and self.check_master_state(state, service_name):
                # To the front. Found again, not by its index when asked: a
                # lookup at the same time (the follower's, a connection's)
                # may have moved it, and a swap by a stale index doubles one
                # Sentinel and loses another.
                index = self.sentinels.index(sentinel)
                self.sentinels[0], self.sentinels[index] = sentinel, self.sentinels[0]
                return state["ip"], state["port"]
            problems.append(
                f"{where}: " + ("monitors no such master" if not state else "sees the master down")
            )
        detail = "; ".join(problems)
        if refused and refused == len(self.sentinels):
            raise AuthenticationError(
                f"every Sentinel refused the credentials (redis.sentinels, redis.sentinel_password): {detail}"
            )
        raise MasterNotFoundError(f"no Sentinel names a master {service_name!r}: {detail}")


FOLLOW_S = 1.0  # how often a client asks the Sentinels which server is master


class SentinelMaster(aioredis.Redis):
    """The master client :func:`connect_master` returns.

    redis-py asks the Sentinels for the master only when it opens a
    connection, and an old master that Sentinel has replaced stays a writable
    master until Sentinel turns it into a replica (about 10 s later), so
    connections already open would go on writing there, into data the
    failover discards. :meth:`follow` asks the Sentinels every
    :data:`FOLLOW_S` and, when they name another master, closes the idle
    connections and has each busy one dropped before its next command. Closing
    the client stops that and closes its clients of the Sentinels (redis-py
    leaves those to the caller).
    """

    _follower: asyncio.Task[None] | None = None

    def follow(self) -> None:
        """Start following the Sentinels' master, once (needs a running loop)."""
        if self._follower is None:
            self._follower = asyncio.get_running_loop().create_task(
                self._follow(), name="sentinel-follow"
            )

    async def _follow(self) -> None:
        pool = cast(SentinelConnectionPool, self.connection_pool)
        while True:
            await asyncio.sleep(FOLLOW_S)
            try:
                address = await pool.sentinel_manager.discover_master(pool.service_name)
            except (RedisError, OSError):
                continue  # no Sentinel answers now: the connections stay as they are
            old = pool.master_address
            if old is None or tuple(address) == tuple(old):
                continue
            pool.master_address = address  # busy connections leave it (Dropping.connect)
            log.warning(
                "redis_master_switched",
                service=pool.service_name,
                old=f"{old[0]}:{old[1]}",
                new=f"{address[0]}:{address[1]}",
            )
            with contextlib.suppress(RedisError, OSError):
                await pool.disconnect(inuse_connections=False)

    async def aclose(self, close_connection_pool: bool | None = None) -> None:
        follower, self._follower = self._follower, None
        try:
            if follower is not None:
                follower.cancel()
                # wait(), not ``await follower`` in suppress(CancelledError):
                # that would swallow a cancel of this task too.
                await asyncio.wait([follower])
        finally:
            try:
                await super().aclose(close_connection_pool)
            finally:
                pool = self.connection_pool
                if isinstance(pool, SentinelConnectionPool):
                    await pool.sentinel_manager.aclose()


def connect_master(
    settings: RedisSettings,
    common: dict[str, Any],
    tls: dict[str, Any],
    outages: tuple[type[BaseException], ...],
) -> aioredis.Redis:
    """A client of the master the Sentinels name for ``redis.service_name``.

    ``common`` are the options every connection gets (timeouts, retry, decoding),
    ``tls`` the ``redis.tls_*`` files as redis-py's ``ssl_*`` options,
    ``outages`` the errors after which a connection is dropped (and so the
    master looked up again on its next command).
    """
    addresses = sentinel_addresses(settings)
    url = urlsplit(settings.url)
    if url.scheme not in ("redis", "rediss"):
        raise SettingsError(
            f"redis.sentinels is set but redis.url {redact_url(settings.url)!r} is not redis:// or rediss:// "
            "(with Sentinel it gives the master's scheme, database and credentials)"
        )
    master_tls = url.scheme == "rediss"
    sentinel_tls = {master_tls if a.tls is None else a.tls for a in addresses}
    credentials = {(a.username, a.password) for a in addresses}
    if len(sentinel_tls) > 1 or len(credentials) > 1:
        raise SettingsError(
            "redis.sentinels: every sentinel must use the same scheme (TLS or not) and the same "
            "credentials; redis-py reaches all of them with one set of options"
        )
    username, password = credentials.pop()
    if settings.sentinel_password:
        password = settings.sentinel_password
    socket = {k: v for k, v in common.items() if k.startswith("socket_")}
    sentinel_kwargs: dict[str, Any] = {**socket, "retry": common.get("retry")}
    if username:
        sentinel_kwargs["username"] = username
    if password:
        sentinel_kwargs["password"] = password
    if sentinel_tls.pop():
        sentinel_kwargs.update({"ssl": True, "ssl_cert_reqs": "required", **tls})

    # The master: what redis.url says but its address (database, user, password,
    # query parameters), then the settings' user and password, as without Sentinel.
    master: dict[str, Any] = {
        k: v
        for k, v in parse_url(settings.url).items()
        if k not in ("host", "port", "connection_class")
    }
    master.update(common)
    if settings.username:
        master["username"] = settings.username
    if settings.password:
        master["password"] = settings.password
    if master_tls:
        master.update({"ssl_cert_reqs": "required", **tls})
    base = SentinelManagedSSLConnection if master_tls else SentinelManagedConnection
    master["connection_class"] = _dropping(base, outages)
    sentinel = Sentinels(  # type: ignore[no-untyped-call]
        [(a.host, a.port) for a in addresses],
        sentinel_kwargs=sentinel_kwargs,
    )
    client = sentinel.master_for(settings.service_name, redis_class=SentinelMaster, **master)
    return cast(SentinelMaster, client)
