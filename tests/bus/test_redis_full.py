"""A full Redis: streams stay trimmed, publishers back off, readers go on.

Every XADD of the bus carries an approximate MAXLEN (``bus.maxlen_*``), so a
stream does not grow past its bound plus one stream node. When Redis is full
anyway (``maxmemory`` reached under ``noeviction``) it refuses XADD with OOM:
publishers back off (delays doubling to ``redis.backoff_max_s``) and publish
once memory is freed, without a duplicate; consumers, whose XREADGROUP and
XACK Redis allows when full, keep reading meanwhile. Nothing exits.
"""

from __future__ import annotations

import asyncio

import redis.asyncio as aioredis
from structlog.testing import capture_logs

from star.bus import Bus, GroupReader
from star.wire import Decision
from tests.bus.test_outage_replies import retried
from tests.bus.test_subscriber_outage import SETTLE_S, decision, stop, wait_until
from tests.conftest import bus_settings, redis_settings
from tests.redis_server import RedisServer

NODE = 100  # redis-server's stream-node-max-entries: approximate trimming drops whole nodes


async def test_streams_stay_near_their_maxlen(own_redis: RedisServer) -> None:
    bus = Bus.from_settings(redis_settings(own_redis), bus_settings(maxlen_decisions=200))
    try:
        for i in range(1500):
            await bus.publish("decisions", decision(i))
        assert 200 <= await bus.redis.xlen(bus.keys.decisions) <= 200 + NODE
    finally:
        await bus.close()


async def test_a_full_redis_stops_publishers_not_readers(own_redis: RedisServer) -> None:
    rs = redis_settings(own_redis, backoff_max_s=0.2, reconnect_timeout_s=SETTLE_S)
    bs = bus_settings()
    producer = Bus.from_settings(rs, bs)
    reader_bus = Bus.from_settings(rs, bs)
    admin = aioredis.Redis.from_url(own_redis.url)
    reader = GroupReader(reader_bus, "decisions", "g", "c1", Decision)
    got: list[str] = []

    async def consume() -> None:
        async for batch in reader:
            got.extend(e.msg.id for e in batch if isinstance(e.msg, Decision))

    consumer = asyncio.create_task(consume())
    try:
        with capture_logs() as logs:
            for i in range(20):
                await producer.publish("decisions", decision(i))
            await wait_until(lambda: len(got) == 20, "the first entries")
            late = GroupReader(reader_bus, "decisions", "late", "c1", Decision)
            # Read before Redis is full (creating a group, XGROUP CREATE, needs memory).
            batch = await late.read()
            assert [e.msg.id for e in batch if isinstance(e.msg, Decision)] == got
            await admin.config_set("maxmemory-policy", "noeviction")
            await admin.config_set("maxmemory", 1)  # full
            publisher = asyncio.create_task(producer.publish("decisions", decision(20)))
            await retried(logs, publisher, "XADD", "maxmemory", times=6)
            # Backing off: the delays double up to backoff_max_s.
            delays = [
                float(e["delay_s"])
                for e in logs
                if e["event"] == "redis_unreachable_retrying" and str(e["op"]).startswith("XADD")
            ]
            assert delays == sorted(delays) and delays[-1] == 0.2
            # Readers are not refused: a consumer group acknowledges and reads.
            await late.ack(*(e.id for e in batch))
            assert await late.pending() == 0
            assert await late.read(block_ms=50) == []
            assert not publisher.done()
            await admin.config_set("maxmemory", 0)  # memory freed
            async with asyncio.timeout(SETTLE_S):
                await publisher
            await wait_until(lambda: "d20" in got, "the entry published after the outage")
            assert not consumer.done(), consumer
            await stop(consumer)
        assert got == [f"d{i}" for i in range(21)]  # once each
        assert any(e["event"] == "redis_reachable_again" for e in logs)
    finally:
        consumer.cancel()
        await producer.close()
        await reader_bus.close()
        await admin.aclose()
