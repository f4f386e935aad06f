"""Redis Sentinel as the bus's Redis (``redis.sentinels``), on real processes.

A master, a replica and a Sentinel (``tests/bus/sentinel_set.py``); the
master runs with ``min-replicas-to-write 1``, the setting docs/operations.md
asks for, so once its replica is promoted it refuses writes (NOREPLICAS, an
outage) instead of taking writes the failover discards. Across a
``SENTINEL FAILOVER``, and across a SIGKILL of the master, a publisher and a consumer group keep going on the new
master with every entry delivered once (the new master may lack the old one's
last entries, taken in the instant before it noticed the promotion:
asynchronous replication); the scheduler's fence never repeats.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio as aioredis
from structlog.testing import capture_logs

from scheduler.leader import Leadership
from star.bus import Bus, BusUnavailable, GroupReader, as_str, xrevrange
from star.ports import free_port
from star.redis_sentinel import FOLLOW_S, SentinelMaster
from star.settings import RedisSettings
from star.wire import Decision
from tests.bus.sentinel_set import SERVICE, SentinelSet
from tests.bus.test_subscriber_outage import SETTLE_S, decision, stop, wait_until
from tests.conftest import bus_settings

PUBLISHED = 120
FAILOVER_AT = 40


@pytest.fixture
def sentinel_set(tmp_path: Path) -> Iterator[SentinelSet]:
    cluster = SentinelSet(tmp_path, replicas=1, sentinels=1)
    # On the master alone: the promoted replica takes writes at once (with the
    # setting on every node, as in production, it waits for a replica first).
    cluster.data_args = ()
    cluster.start()
    with cluster.data[0].client() as master:
        master.config_set("min-replicas-to-write", 1)
        master.config_set("min-replicas-max-lag", 10)
        deadline = time.monotonic() + SETTLE_S
        while (
            master.info("replication").get("min_slaves_good_slaves") != 1
        ):  # counted once a second
            assert time.monotonic() < deadline, "the master does not count its replica"
            time.sleep(0.05)
    yield cluster
    cluster.stop()


def sentinel_settings(cluster: SentinelSet, **kw: Any) -> RedisSettings:
    # The first Sentinel named is down: it is skipped.
    defaults: dict[str, Any] = {
        "url": "redis://ignored.invalid:1/0",  # with Sentinel the master's address is not read from it
        "sentinels": (f"127.0.0.1:{free_port()}", *cluster.addresses),
        "service_name": SERVICE,
        "connect_timeout_s": 0.5,
        "socket_timeout_s": 2.0,
        "backoff_base_s": 0.02,
        "backoff_max_s": 0.2,
        "reconnect_timeout_s": 15.0,
    }
    defaults.update(kw)
    return RedisSettings(**defaults)


@pytest.mark.parametrize("how", ["sentinel-failover", "master-killed"])
async def test_publisher_and_group_reader_follow_a_sentinel_failover(
    sentinel_set: SentinelSet, how: str
) -> None:
    rs, bs = sentinel_settings(sentinel_set), bus_settings()
    producer = Bus.from_settings(rs, bs)
    reader_bus = Bus.from_settings(rs, bs)
    assert isinstance(producer.redis, SentinelMaster)
    reader = GroupReader(reader_bus, "decisions", "g", "c1", Decision)
    got: list[str] = []
    published: list[str] = []
    half = asyncio.Event()

    async def consume() -> None:
        async for batch in reader:
            got.extend(e.msg.id for e in batch if isinstance(e.msg, Decision))

    async def publish() -> None:
        for i in range(PUBLISHED):
            published.append(await producer.publish("decisions", decision(i)))
            if i == FAILOVER_AT:
                half.set()
            await asyncio.sleep(0.01)

    old = sentinel_set.master()
    with capture_logs() as logs:
        consumer = asyncio.create_task(consume())
        publisher = asyncio.create_task(publish())
        try:
            async with asyncio.timeout(SETTLE_S):
                await half.wait()
            started = time.monotonic()
            switch = (
                sentinel_set.failover if how == "sentinel-failover" else sentinel_set.kill_master
            )
            new = await asyncio.to_thread(switch)
            assert new is not old
            async with asyncio.timeout(SETTLE_S):
                await publisher
            await wait_until(lambda: len(got) >= PUBLISHED, "every entry at the consumer")
            await asyncio.sleep(0.3)  # nothing more (no duplicates) comes
            assert not consumer.done(), consumer
            await stop(consumer)
            switched_s = time.monotonic() - started
        finally:
            consumer.cancel()
            publisher.cancel()
            await producer.close()
            await reader_bus.close()
    # Every entry delivered once, in order.
    assert got == [f"d{i}" for i in range(PUBLISHED)]
    client = aioredis.Redis(port=new.port)
    try:
        rows = await xrevrange(client, producer.keys.decisions, 1000)
        kept = [as_str(i) for i, _ in rows][::-1]
        # On the new master, in order and once, every entry but at most the old
        # master's last ones: an XADD it took in the instant between its
        # replica's promotion and its noticing the replica gone (asynchronous
        # replication; the consumer got it from the old master).
        assert kept == [i for i in published if i in kept]
        lost = [published.index(i) for i in published if i not in kept]
        assert len(lost) <= 2 and all(i >= FAILOVER_AT for i in lost), lost
        assert as_str((await client.execute_command("ROLE"))[0]) == "master"  # type: ignore[no-untyped-call]
        pending = await client.xpending(producer.keys.decisions, "g")
        assert pending["pending"] == 0
    finally:
        await client.aclose()
    # The old master refused writes (NOREPLICAS) or reads (UNBLOCKED/READONLY)
    # until the clients found the new one: outages, retried, never an exit.
    retried = [e for e in logs if e["event"] == "redis_unreachable_retrying"]
    assert retried, "the failover went unnoticed"
    assert switched_s < 30


async def test_the_fence_never_repeats_across_a_failover(sentinel_set: SentinelSet) -> None:
    rs, bs = sentinel_settings(sentinel_set), bus_settings()
    bus_a = Bus.from_settings(rs, bs)
    bus_b = Bus.from_settings(rs, bs)
    a = Leadership(bus_a, "a", ttl_s=1.0)
    b = Leadership(bus_b, "b", ttl_s=1.0)
    replica = sentinel_set.data[1]
    assert replica.proc is not None
    try:
        # Rule 1: a fence no replica acknowledged is never used.
        os.kill(replica.proc.pid, signal.SIGSTOP)
        try:
            with capture_logs() as logs:
                assert await a.step() is False
            assert [e["event"] for e in logs] == ["leadership_not_replicated"]
            assert a.fence == 0 and await a.current() is None  # the lock went back
        finally:
            os.kill(replica.proc.pid, signal.SIGCONT)
        assert await a.step() is True
        first = a.fence
        assert await b.step() is False and b.seen == first  # b saw a's fence

        new = await asyncio.to_thread(sentinel_set.failover)
        # Rule 2: the promoted replica's counter is behind (as if a's INCR had
        # not reached it before the promotion): b's floor still puts it above.
        client = aioredis.Redis(port=new.port)
        try:
            await client.set(bus_b.keys.fence, 0)
            await client.delete(bus_b.keys.leader)  # a's lock lapsed meanwhile
        finally:
            await client.aclose()
        deadline = time.monotonic() + SETTLE_S
        while True:
            try:
                if await b.step():
                    break
            except Exception:  # the switch: outages until b's pool follows
                pass
            assert time.monotonic() < deadline, "b never led on the new master"
            await asyncio.sleep(0.1)
        assert b.fence > first
        assert (await b.current()) == ("b", b.fence)
    finally:
        await bus_a.close()
        await bus_b.close()


async def test_the_passwords_of_the_master_and_of_the_sentinels(tmp_path: Path) -> None:
    cluster = SentinelSet(tmp_path, password="master-pw-1234", sentinel_password="sentry-pw-5678")
    cluster.start()
    try:
        # The Sentinels' password in their URLs, the master's in redis.password.
        urls = tuple(f"redis://:sentry-pw-5678@{a}" for a in cluster.addresses)
        good = sentinel_settings(cluster, sentinels=urls, password="master-pw-1234")
        bus = Bus.from_settings(good, bus_settings())
        try:
            entry = await bus.publish("decisions", decision(0))
            assert [as_str(i) for i, _ in await xrevrange(bus.redis, bus.keys.decisions, 5)] == [
                entry
            ]
        finally:
            await bus.close()
        # redis.sentinel_password overrides the URLs'. A wrong one: refused at
        # once, naming the Sentinels, never a password.
        wrong = sentinel_settings(
            cluster,
            sentinels=urls,
            sentinel_password="wrong-pw-0000",
            password="master-pw-1234",
        )
        bus = Bus.from_settings(wrong, bus_settings())
        try:
            started = time.monotonic()
            with pytest.raises(BusUnavailable) as err:
                await bus.publish("decisions", decision(1))
            assert time.monotonic() - started < 5
        finally:
            await bus.close()
        text = str(err.value)
        assert f"master {SERVICE!r} of Sentinels redis://:***@" in text
        assert "every Sentinel refused the credentials" in text
        assert "invalid username-password pair" in text, text
        assert "pw-" not in text.replace("redis://:***@", "")
        # A wrong password of the master: refused at once, as without Sentinel.
        bad_master = sentinel_settings(cluster, sentinels=urls, password="not-the-master-pw")
        bus = Bus.from_settings(bad_master, bus_settings())
        try:
            started = time.monotonic()
            with pytest.raises(BusUnavailable, match="refused the credentials"):
                await bus.publish("decisions", decision(2))
            assert time.monotonic() - started < 5
        finally:
            await bus.close()
    finally:
        cluster.stop()


async def test_clients_leave_a_replaced_master_that_still_takes_writes(tmp_path: Path) -> None:
    """Without ``min-replicas-to-write`` the old master stays a writable master
    for about 10 s after ``SENTINEL FAILOVER``, and nothing tells its clients:
    they follow the Sentinels (every ``FOLLOW_S``) and move on their own. What
    they wrote to the old master before that is lost, a bounded window."""
    cluster = SentinelSet(tmp_path, replicas=1, sentinels=1)
    cluster.start()
    rs, bs = sentinel_settings(cluster), bus_settings()
    producer = Bus.from_settings(rs, bs)
    reader_bus = Bus.from_settings(rs, bs)
    reader = GroupReader(reader_bus, "decisions", "g", "c1", Decision)
    got: list[str] = []
    published: list[tuple[float, str, str]] = []  # (when, decision id, entry id)
    half = asyncio.Event()
    total = 400

    async def consume() -> None:
        async for batch in reader:
            got.extend(e.msg.id for e in batch if isinstance(e.msg, Decision))

    async def publish() -> None:
        for i in range(total):
            entry = await producer.publish("decisions", decision(i))
            published.append((time.monotonic(), f"d{i}", entry))
            if i == FAILOVER_AT:
                half.set()
            await asyncio.sleep(0.01)

    old = cluster.master()
    with capture_logs() as logs:
        consumer = asyncio.create_task(consume())
        publisher = asyncio.create_task(publish())
        try:
            async with asyncio.timeout(SETTLE_S):
                await half.wait()
            switched = time.monotonic()
            new = await asyncio.to_thread(cluster.failover)
            async with asyncio.timeout(SETTLE_S):
                await publisher
            settled = switched + 2 * FOLLOW_S + 1.0  # both clients have moved by then
            assert published[-1][0] > settled + 0.5, "publish longer after the failover"
            late = [d for t, d, _ in published if t > settled]
            await wait_until(lambda: set(late) <= set(got), "the entries after the switch")
            await stop(consumer)
            with old.client() as client:  # not yet turned into a replica
                assert as_str(client.execute_command("ROLE")[0]) == "master"
            with new.client() as client:
                kept = {as_str(i) for i, _ in client.xrange(producer.keys.decisions)}
        finally:
            consumer.cancel()
            publisher.cancel()
            await producer.close()
            await reader_bus.close()
            cluster.stop()
    assert sum(1 for e in logs if e["event"] == "redis_master_switched") == 2  # each client
    # Once each: nothing the consumer got twice.
    assert len(got) == len(set(got))
    assert got[-len(late) :] == late
    # Only what was written around the switch can be missing from the new master.
    missing = [t for t, _, entry in published if entry not in kept]
    assert all(switched <= t <= settled for t in missing), (len(missing), switched, settled)
