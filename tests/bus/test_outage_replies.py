"""Error replies that mean "no usable master right now" are outages, not errors.

A demoted master answers READONLY (and UNBLOCKED to a blocked XREADGROUP),
a full one under noeviction OOM, one running a long script BUSY, and so on
(:data:`star.bus.connection.OUTAGE_REPLIES`): every publisher and reader waits
them out like a dead Redis (``redis_unreachable_retrying``, then
:class:`BusUnavailable` after ``reconnect_timeout_s``; an iterating reader
goes on). Each scenario runs on the test's own redis-server.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any

import pytest
import redis.asyncio as aioredis
from redis._parsers import _AsyncHiredisParser, _AsyncRESP2Parser
from redis.asyncio.connection import DefaultParser
from redis.exceptions import RedisError, ResponseError
from structlog.testing import capture_logs

from scheduler.service import REDIS_DOWN
from star.bus import Bus, BusUnavailable, GroupReader, as_str, xrevrange
from star.ports import free_port
from star.wire import Decision
from tests.bus.test_subscriber_outage import SETTLE_S, decision, stop, wait_until
from tests.conftest import bus_settings, redis_settings
from tests.redis_server import RedisServer


@pytest.fixture
async def admin(own_redis: RedisServer) -> AsyncIterator[aioredis.Redis]:
    """A plain client of the test's own server, for REPLICAOF, CONFIG and the like."""
    client = aioredis.Redis.from_url(own_redis.url)
    yield client
    await client.aclose()


def retries(logs: Sequence[Mapping[str, Any]], op: str, error: str) -> int:
    return sum(
        1
        for e in logs
        if e["event"] == "redis_unreachable_retrying"
        and str(e["op"]).startswith(op)
        and error in str(e["error"])
    )


async def retried(
    logs: Sequence[Mapping[str, Any]], task: asyncio.Task[Any], op: str, error: str, times: int = 2
) -> None:
    """Wait until ``op`` was retried ``times`` after ``error``; ``task`` must not end meanwhile."""
    await wait_until(lambda: task.done() or retries(logs, op, error) >= times, f"{op} retried")
    assert not task.done(), task.exception() if not task.cancelled() else task


async def demote(admin: aioredis.Redis) -> None:
    """Make the server a replica of a master that is not there (READONLY from now on)."""
    await admin.execute_command("REPLICAOF", "127.0.0.1", free_port())  # type: ignore[no-untyped-call]


async def promote(admin: aioredis.Redis) -> None:
    await admin.execute_command("REPLICAOF", "NO", "ONE")  # type: ignore[no-untyped-call]


async def connections(admin: aioredis.Redis) -> int:
    """How many connections the server has accepted so far."""
    return int((await admin.info("stats"))["total_connections_received"])


async def entries(admin: aioredis.Redis, key: str) -> list[str]:
    return [as_str(i) for i, _ in await xrevrange(admin, key, 100)][::-1]


async def test_publish_waits_out_a_demoted_master(
    own_redis: RedisServer, admin: aioredis.Redis
) -> None:
    bus = Bus.from_settings(redis_settings(own_redis), bus_settings())
    try:
        await bus.publish("decisions", decision(0))
        dialed = await connections(admin)
        with capture_logs() as logs:
            await demote(admin)
            task = asyncio.create_task(bus.publish("decisions", decision(1)))
            await retried(logs, task, "XADD", "read only replica")
            await promote(admin)
            async with asyncio.timeout(SETTLE_S):
                entry_id = await task
        assert any(e["event"] == "redis_reachable_again" for e in logs)
        # Each retry dialed again (a moved host name is resolved again).
        assert await connections(admin) - dialed >= 2
        assert (await entries(admin, bus.keys.decisions))[1:] == [entry_id]
    finally:
        await bus.close()


async def test_publish_waits_out_a_full_redis(
    own_redis: RedisServer, admin: aioredis.Redis
) -> None:
    bus = Bus.from_settings(redis_settings(own_redis), bus_settings())
    try:
        await bus.publish("decisions", decision(0))
        with capture_logs() as logs:
            await admin.config_set("maxmemory-policy", "noeviction")
            await admin.config_set("maxmemory", 1)
            task = asyncio.create_task(bus.publish("decisions", decision(1)))
            await retried(logs, task, "XADD", "maxmemory")
            await admin.config_set("maxmemory", 0)
            async with asyncio.timeout(SETTLE_S):
                entry_id = await task
        assert (await entries(admin, bus.keys.decisions))[1:] == [entry_id]
    finally:
        await bus.close()


async def test_publish_waits_out_a_busy_script(
    own_redis: RedisServer, admin: aioredis.Redis
) -> None:
    bus = Bus.from_settings(redis_settings(own_redis), bus_settings())
    # Its own client, without a socket timeout: the script holds it until killed.
    runner = aioredis.Redis.from_url(own_redis.url, socket_timeout=None)
    killer = aioredis.Redis.from_url(own_redis.url)
    try:
        await bus.publish("decisions", decision(0))
        await admin.config_set("busy-reply-threshold", 100)
        script: asyncio.Future[Any] = asyncio.ensure_future(runner.eval("while true do end", 0))
        with capture_logs() as logs:
            await asyncio.sleep(0.3)  # past busy-reply-threshold
            task = asyncio.create_task(bus.publish("decisions", decision(1)))
            await retried(logs, task, "XADD", "busy")
            await killer.script_kill()
            with pytest.raises(ResponseError, match="killed"):
                await script
            async with asyncio.timeout(SETTLE_S):
                entry_id = await task
        assert (await entries(admin, bus.keys.decisions))[1:] == [entry_id]
    finally:
        if not script.done():  # a failed test: free the server
            with contextlib.suppress(ResponseError):
                await killer.script_kill()
        await bus.close()
        await runner.aclose()
        await killer.aclose()


async def test_publish_gives_up_on_a_lasting_demotion_as_on_a_dead_redis(
    own_redis: RedisServer, admin: aioredis.Redis
) -> None:
    bus = Bus.from_settings(redis_settings(own_redis, reconnect_timeout_s=0.3), bus_settings())
    try:
        await demote(admin)
        with pytest.raises(BusUnavailable, match="read only replica"):
            await bus.publish("decisions", decision(0))
        await promote(admin)
        await bus.publish("decisions", decision(0))  # and the next call works
    finally:
        await bus.close()


async def test_blocked_group_reader_survives_a_demotion(
    own_redis: RedisServer, admin: aioredis.Redis
) -> None:
    # Long blocks (socket_timeout_s 2.0 caps them at 1 s): the demotion finds
    # the reader blocked in XREADGROUP, which Redis ends with UNBLOCKED.
    rs = redis_settings(own_redis, reconnect_timeout_s=0.3)
    bs = bus_settings(block_ms=1000)
    producer = Bus.from_settings(rs, bs)
    reader_bus = Bus.from_settings(rs, bs)
    reader = GroupReader(reader_bus, "reports", "sched", "c1", Decision)
    seen: list[str] = []

    async def consume() -> None:
        async for batch in reader:
            seen.extend(e.id for e in batch)

    async def blocked() -> None:
        """Until the reader waits in a blocking XREADGROUP."""
        async with asyncio.timeout(SETTLE_S):
            while True:
                if int((await admin.info("clients"))["blocked_clients"]):
                    return
                await asyncio.sleep(0.01)

    with capture_logs() as logs:
        published = [await producer.publish("reports", decision(0))]
        task = asyncio.create_task(consume())
        try:
            await wait_until(lambda: seen == published, "the first entry")
            await blocked()
            await demote(admin)
            await retried(logs, task, "XREADGROUP", "force unblock", times=1)
            # A replica for several reconnect timeouts: reads end in BusUnavailable.
            await wait_until(
                lambda: any(e["event"] == "stream_unreadable" for e in logs),
                "a read giving up",
            )
            await asyncio.sleep(1.0)
            assert not task.done(), task
            await promote(admin)
            published.append(await producer.publish("reports", decision(1)))
            await wait_until(lambda: len(seen) >= 2, "the entry after the demotion")
            await asyncio.sleep(0.3)  # nothing more (no duplicate) comes
            await stop(task)
        finally:
            task.cancel()
            await producer.close()
            await reader_bus.close()
    assert seen == published  # each entry once
    unreadable = [e for e in logs if e["event"] == "stream_unreadable"]
    assert len(unreadable) == 1  # one line per outage
    assert sum(1 for e in logs if e["event"] == "stream_readable_again") == 1


OUTAGES = ["READONLY", "OOM", "MASTERDOWN", "LOADING", "TRYAGAIN", "BUSY", "UNBLOCKED"]
NOT_OUTAGES = ["ERR", "WRONGTYPE", "NOGROUP", "BUSYGROUP", "BUSYKEY", "NOPERM", "WRONGPASS"]


@pytest.mark.parametrize("parser", ["hiredis", "python"])
async def test_which_error_replies_are_outages(redis_server: RedisServer, parser: str) -> None:
    """The real server sends each reply (a script's error_reply) through either
    of redis-py's parsers: Connection.retrying waits out exactly the outage
    ones (then BusUnavailable), and the scheduler's ticks count them (and only
    them) as Redis being down. WRONGPASS ends at once (refused credentials)."""
    rs = redis_settings(redis_server, reconnect_timeout_s=0.1)
    if parser == "hiredis":
        assert DefaultParser is _AsyncHiredisParser  # the parser STAR runs with
        bus = Bus.from_settings(rs, bus_settings())
    else:
        client = aioredis.Redis.from_url(redis_server.url, parser_class=_AsyncRESP2Parser)
        bus = Bus(client, bus_settings(), rs)
    retried: dict[str, bool] = {}
    try:
        for prefix in OUTAGES + NOT_OUTAGES:

            async def reply(prefix: str = prefix) -> Any:
                return await bus.redis.eval(f"return redis.error_reply('{prefix} some reason')", 0)

            with pytest.raises(RedisError) as raw:
                await reply()
            with capture_logs() as logs, pytest.raises((RedisError, BusUnavailable)) as caught:
                await bus.retrying("EVAL", reply)
            retried[prefix] = any(e["event"] == "redis_unreachable_retrying" for e in logs)
            if retried[prefix]:
                assert isinstance(caught.value, BusUnavailable)
            if prefix in OUTAGES:
                assert isinstance(raw.value, REDIS_DOWN)
            elif prefix != "WRONGPASS":  # an AuthenticationError, a ConnectionError
                assert not isinstance(raw.value, REDIS_DOWN)
                assert caught.value is not None and type(caught.value) is type(raw.value)
    finally:
        await bus.close()
    assert retried == {p: p in OUTAGES for p in OUTAGES + NOT_OUTAGES}
