"""``async for entry in Subscriber`` across Redis outages and cancellation.

The outage tests kill the test's own redis-server for several
``reconnect_timeout_s`` (so every read in between ends in
:class:`BusUnavailable`) and start it again; the reader must go on by itself,
deliver every entry once and in order, log the outage once, and still end
when its task is cancelled.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pytest
from structlog.testing import capture_logs

from star.bus import Bus, Entry, Subscriber, as_str
from star.wire import Decision, encode
from tests.conftest import bus_settings, redis_settings
from tests.redis_server import RedisServer

# Generous: these bound a wait for something that must happen, on a loaded box.
SETTLE_S = 60.0


def decision(i: int) -> Decision:
    return Decision(
        id=f"d{i}",
        request=f"r{i}",
        source="a",
        target="b",
        tick=i,
        delta_v=-1.0,
        mode="current",
        ts=time.time(),
    )


async def wait_until(cond: Any, what: str) -> None:
    deadline = time.monotonic() + SETTLE_S
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)


async def stop(task: asyncio.Task[Any]) -> None:
    """Cancel ``task`` and check that it ends (a swallowed cancel used to hang here)."""
    task.cancel()
    done, _ = await asyncio.wait({task}, timeout=SETTLE_S)
    assert done, "the follower ignored cancel()"
    assert task.cancelled()


async def follow_during_outage(
    server: RedisServer, before: Any, after: Any
) -> tuple[list[str], list[str], list[Any]]:
    """Follow ``decisions`` while ``server`` is killed for several reconnect timeouts.

    ``before(bus)`` / ``after(bus)`` publish and return entry ids. Returns
    (ids published, ids seen, log lines).
    """
    rs = redis_settings(server, reconnect_timeout_s=0.3)
    bs = bus_settings()  # one settings object: both buses share the key prefix
    producer = Bus.from_settings(rs, bs)
    reader = Bus.from_settings(rs, bs)
    sub = Subscriber(reader, "decisions", Decision, start="0")
    seen: list[str] = []

    async def follow() -> None:
        async for entry in sub:
            seen.append(entry.id)

    with capture_logs() as logs:
        task = asyncio.create_task(follow())
        try:
            published = await before(producer)
            await wait_until(lambda: len(seen) >= len(published), "the entries before the outage")
            await asyncio.to_thread(server.kill)
            # Several reconnect timeouts: the reader's reads end in BusUnavailable.
            await wait_until(
                lambda: sum(1 for e in logs if e["event"] == "redis_unreachable_retrying") >= 20,
                "retries",
            )
            await asyncio.sleep(1.0)
            await asyncio.to_thread(server.start)
            published += await after(producer)
            await wait_until(lambda: len(seen) >= len(published), "the entries after the outage")
            await asyncio.sleep(0.2)  # nothing more (no duplicates) comes
            await stop(task)
        finally:
            task.cancel()
            await producer.close()
            await reader.close()
    return published, seen, logs


async def publish(bus: Bus, ids: range) -> list[str]:
    return [await bus.publish("decisions", decision(i)) for i in ids]


async def test_iteration_outlives_an_outage_longer_than_reconnect_timeout(
    own_redis: RedisServer,
) -> None:
    published, seen, logs = await follow_during_outage(
        own_redis, lambda b: publish(b, range(10)), lambda b: publish(b, range(10, 20))
    )
    assert len(published) == 20
    assert seen == published  # every entry once, in order
    unreadable = [e for e in logs if e["event"] == "stream_unreadable"]
    assert len(unreadable) == 1  # one line per outage, however many reconnect timeouts it lasted
    assert unreadable[0]["log_level"] == "error"
    assert [e["event"] for e in logs].count("stream_readable_again") == 1


async def test_iteration_resumes_when_redis_comes_back_without_the_stream(tmp_path: Path) -> None:
    """Restart without persistence: the new entries' ids are older than the last
    one seen (here the old ones were written with ids an hour ahead), so reading
    on after that id would skip them all."""
    server = RedisServer(tmp_path, persistent=False)
    server.start()
    ahead_ms = int(time.time() * 1000) + 3_600_000

    async def before(bus: Bus) -> list[str]:
        out = []
        for i in range(5):
            msg = decision(i)
            fields: dict[Any, Any] = {**msg.summary(), "body": encode(msg)}
            out.append(
                as_str(await bus.redis.xadd(bus.keys.decisions, fields, id=f"{ahead_ms}-{i}"))
            )
        return out

    try:
        published, seen, logs = await follow_during_outage(
            server, before, lambda b: publish(b, range(5, 15))
        )
    finally:
        server.stop()
    assert seen == published
    assert any(e["event"] == "stream_went_back_rereading" for e in logs)


async def test_iteration_yields_a_batch_once_across_a_break(bus: Bus) -> None:
    published = await publish(bus, range(6))
    sub = Subscriber(bus, "decisions", Decision, start="0")
    got: list[Entry] = []
    async for entry in sub:  # the first read fetches all six
        got.append(entry)
        if len(got) == 2:
            break
    async for entry in sub:
        got.append(entry)
        if len(got) == 6:
            break
    assert [e.id for e in got] == published


async def drain(sub: Subscriber) -> None:
    async for _entry in sub:
        pass


async def test_cancelling_a_follower_ends_it(bus: Bus) -> None:
    """Cancel lands at any point of the read loop, including just after a
    command's send finished (Python 3.11's asyncio.wait_for in redis-py used to
    swallow that one, and the follower read on forever)."""
    reader = Bus(
        bus.redis, bus_settings(prefix=bus.settings.prefix, block_ms=5), bus.redis_settings
    )
    for i in range(60):
        task = asyncio.create_task(drain(Subscriber(reader, "decisions", Decision, start="0")))
        await bus.publish("decisions", decision(i))
        await asyncio.sleep((i % 12) * 0.002)
        await stop(task)


async def test_retrying_raises_a_cancel_the_operation_swallowed(bus: Bus) -> None:
    started = asyncio.Event()
    calls = 0

    async def swallowing_op() -> str:
        # What asyncio.wait_for does on 3.11 when its inner send has just finished.
        nonlocal calls
        calls += 1
        started.set()
        try:
            await asyncio.sleep(SETTLE_S)
        except asyncio.CancelledError:
            return "swallowed"
        return "slept"

    task = asyncio.create_task(bus.retrying("op", swallowing_op))
    await started.wait()
    await stop(task)
    assert calls == 1


async def test_cleanup_during_cancellation_still_reaches_redis(bus: Bus) -> None:
    """A task already cancelled may still publish in its cleanup (abort upstream, then re-raise)."""
    started = asyncio.Event()
    ids: list[str] = []

    async def worker() -> None:
        try:
            started.set()
            await asyncio.sleep(SETTLE_S)
        except asyncio.CancelledError:
            ids.append(await bus.publish("decisions", decision(1)))
            raise

    task = asyncio.create_task(worker())
    await started.wait()
    await stop(task)
    assert len(ids) == 1
    assert await bus.redis.xlen(bus.keys.decisions) == 1


@pytest.mark.parametrize("requested", [None, 50, 10_000])
async def test_block_never_reaches_the_socket_timeout(bus: Bus, requested: int | None) -> None:
    cap = int(bus.redis_settings.socket_timeout_s * 1000)
    assert 0 < bus.block_ms(requested) < cap
