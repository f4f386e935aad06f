"""``async for batch in GroupReader`` across Redis outages and cancellation.

The scheduler reads reports this way. The test's own redis-server is killed for
several ``reconnect_timeout_s`` (so every read and ack in between ends in
:class:`BusUnavailable`) and started again: the reader must go on by itself,
deliver every entry once and in order, acknowledge what it delivered (one
batch's ack falls into the outage), and still end promptly when cancelled
during an outage.
"""

from __future__ import annotations

import asyncio
import time

from structlog.testing import capture_logs

from star.bus import Bus, GroupReader
from star.wire import Decision
from tests.bus.test_subscriber_outage import SETTLE_S, decision, stop, wait_until
from tests.conftest import bus_settings, redis_settings
from tests.redis_server import RedisServer

RECONNECT_TIMEOUT_S = 0.3


def outages(logs: list[dict[str, object]]) -> int:
    """How many reads or acks gave up with BusUnavailable (each took a reconnect timeout)."""
    return (
        sum(1 for e in logs if e["event"] == "redis_unreachable_retrying" and e.get("attempt") == 1)
        - 1
    )


async def test_iteration_outlives_an_outage_longer_than_reconnect_timeout(
    own_redis: RedisServer,
) -> None:
    rs = redis_settings(own_redis, reconnect_timeout_s=RECONNECT_TIMEOUT_S)
    bs = bus_settings()
    producer = Bus.from_settings(rs, bs)
    reader_bus = Bus.from_settings(rs, bs)
    reader = GroupReader(reader_bus, "reports", "sched", "c1", Decision)
    seen: list[str] = []
    holding = asyncio.Event()  # the consumer holds its first batch, unacknowledged
    release = asyncio.Event()

    async def consume() -> None:
        async for batch in reader:
            seen.extend(e.id for e in batch)
            if not holding.is_set():
                holding.set()
                await release.wait()  # "processing" until Redis is gone

    with capture_logs() as logs:
        published = [await producer.publish("reports", decision(i)) for i in range(5)]
        task = asyncio.create_task(consume())
        try:
            async with asyncio.timeout(SETTLE_S):
                await holding.wait()
            assert seen == published  # one batch, held unacknowledged
            assert await reader.pending() == 5
            await asyncio.to_thread(own_redis.kill)
            release.set()  # its ack now falls into the outage
            # Several reconnect timeouts: reads and the ack end in BusUnavailable.
            await wait_until(lambda: outages(logs) >= 3, "several reconnect timeouts")
            assert not task.done(), task
            await asyncio.to_thread(own_redis.start)
            published += [await producer.publish("reports", decision(i)) for i in range(5, 10)]
            await wait_until(lambda: len(seen) >= len(published), "the entries after the outage")
            # Everything delivered is acknowledged (the last batch as the reader
            # asks for the next one, which it does at once).
            deadline = time.monotonic() + SETTLE_S
            while await reader.pending():
                assert time.monotonic() < deadline, "entries left pending"
                await asyncio.sleep(0.02)
            await asyncio.sleep(0.2)  # nothing more (no duplicates) comes
            await stop(task)
        finally:
            task.cancel()
            await producer.close()
            await reader_bus.close()
    assert seen == published  # every entry once, in order
    unreadable = [
        e for e in logs if e["event"] == "stream_unreadable" and e["stream"] == reader.key
    ]
    assert len(unreadable) == 1  # one line per outage, however many reconnect timeouts it lasted
    assert unreadable[0]["log_level"] == "error"
    assert (
        sum(1 for e in logs if e["event"] == "stream_readable_again" and e["stream"] == reader.key)
        == 1
    )


async def test_cancelling_during_an_outage_returns_promptly(own_redis: RedisServer) -> None:
    rs = redis_settings(own_redis, reconnect_timeout_s=RECONNECT_TIMEOUT_S)
    bus = Bus.from_settings(rs, bus_settings())
    reader = GroupReader(bus, "reports", "sched", "c1", Decision)
    first = asyncio.Event()

    async def consume() -> None:
        async for _batch in reader:
            first.set()

    with capture_logs() as logs:
        task = asyncio.create_task(consume())
        try:
            await bus.publish("reports", decision(0))
            async with asyncio.timeout(SETTLE_S):
                await first.wait()
            await asyncio.to_thread(own_redis.kill)
            await wait_until(lambda: outages(logs) >= 2, "reads giving up during the outage")
            assert not task.done(), task
            started = time.monotonic()
            task.cancel()
            done, _ = await asyncio.wait({task}, timeout=SETTLE_S)
            assert done and task.cancelled(), "the reader ignored cancel() during the outage"
            # A backoff sleep (0.2 s at most here) or a refused connect; bounded
            # loosely for a loaded machine, where a hang is what this catches.
            assert time.monotonic() - started < 5.0
        finally:
            task.cancel()
            await bus.close()
