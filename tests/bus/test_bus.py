"""The bus adapter against a real redis-server."""

from __future__ import annotations

import asyncio
import time

import msgpack
import pytest
from structlog.testing import capture_logs

from star.bus import Bus, BusUnavailable, GroupReader, Subscriber, parse_dead
from star.wire import Decision, Event, EventKind, LoadEntry, Report, encode
from tests.conftest import bus_settings, redis_settings
from tests.redis_server import RedisServer


def decision(i: int) -> Decision:
    return Decision(
        id=f"d{i}", request=f"r{i}", source="a", target="b", tick=i, delta_v=-1.0 * i, mode="current", ts=time.time()
    )


async def test_publish_writes_readable_fields_and_body(bus: Bus) -> None:
    entry_id = await bus.publish("decisions", decision(1))
    rows = await bus.redis.xrange(bus.keys.decisions)
    assert [r[0].decode() for r in rows] == [entry_id]
    fields = rows[0][1]
    # plain-text fields for redis-cli XRANGE
    assert fields[b"kind"] == b"decision"
    assert fields[b"request"] == b"r1"
    assert fields[b"target"] == b"b"
    assert msgpack.unpackb(fields[b"body"])["request"] == "r1"


async def test_key_prefix_separates_clusters(redis_server: RedisServer) -> None:
    a = Bus.from_settings(redis_settings(redis_server), bus_settings(prefix="alpha"))
    b = Bus.from_settings(redis_settings(redis_server), bus_settings(prefix="beta"))
    try:
        await a.redis.delete("alpha:decisions", "beta:decisions")
        await a.publish("decisions", decision(1))
        assert await a.redis.xlen("alpha:decisions") == 1
        assert await b.redis.xlen("beta:decisions") == 0
    finally:
        await a.close()
        await b.close()


async def test_maxlen_trims_approximately(redis_server: RedisServer) -> None:
    b = Bus.from_settings(redis_settings(redis_server), bus_settings(maxlen_decisions=100))
    try:
        for i in range(1000):
            await b.publish("decisions", decision(i))
        length = await b.redis.xlen(b.keys.decisions)
        assert 100 <= length < 400  # "~" trims whole macro nodes
    finally:
        await b.close()


async def test_group_reader_acks_and_never_redelivers(bus: Bus) -> None:
    ids = [await bus.publish("decisions", decision(i)) for i in range(5)]
    reader = GroupReader(bus, "decisions", "g", "c1", Decision)
    got = await reader.read()
    assert [e.id for e in got] == ids
    assert [e.msg.request for e in got] == [f"r{i}" for i in range(5)]  # type: ignore[attr-defined]
    await reader.ack(*ids[:3])
    assert await reader.pending() == 2
    # A restarted consumer with the same name gets its unacked entries first.
    again = GroupReader(bus, "decisions", "g", "c1", Decision)
    assert [e.id for e in await again.read()] == ids[3:]
    await again.ack(*ids[3:])
    assert await again.read(block_ms=50) == []
    assert await again.pending() == 0


async def test_group_reader_drops_what_a_failover_repeats(bus: Bus) -> None:
    """What a promoted replica can hand out again: an entry whose acknowledgement
    it lacks (the group's position goes back) and an entry the publisher adds
    again after its reply was cut (same body, new id). Neither reaches the
    caller twice; what was never acknowledged still comes again."""
    sent = [decision(i) for i in range(4)]
    ids = [await bus.publish("decisions", m) for m in sent]
    reader = GroupReader(bus, "decisions", "g", "c1", Decision)
    got = await reader.read()
    assert [e.id for e in got] == ids
    await reader.ack(*ids[:3])  # the fourth stays pending, never acknowledged
    # The new master's group is behind, and it lacks the ack of the first three.
    await bus.redis.xgroup_setid(bus.keys.decisions, "g", "0")
    again = await bus.publish("decisions", sent[1], retry=False)  # re-added, new id
    assert again not in ids
    with capture_logs() as logs:
        redelivered = await reader.read()
    assert [e.id for e in redelivered] == [ids[3]]  # only the unacknowledged one
    assert [e["ids"] for e in logs if e["event"] == "duplicate_entries_dropped"] == [
        [*ids[:3], again]
    ]
    await reader.ack(ids[3])
    assert await reader.read(block_ms=50) == []
    assert await reader.pending() == 0  # the dropped repeats were acknowledged
    # A new decision with its own body still comes through.
    fresh = await bus.publish("decisions", decision(9))
    assert [e.id for e in await reader.read()] == [fresh]


async def test_chunks_decode_lazily_let_the_loop_run_between_and_ack_per_batch(
    bus: Bus, monkeypatch: pytest.MonkeyPatch
) -> None:
    ids = [await bus.publish("decisions", decision(i)) for i in range(10)]
    await bus.redis.xadd(bus.keys.decisions, {"kind": "decision", "body": b"\xc1 bad"})
    ids.append(await bus.publish("decisions", decision(10)))
    decoded = 0  # entries decoded so far, good or bad
    decode_fields = bus.decode_fields

    def counting(*args: object) -> object:
        nonlocal decoded
        decoded += 1
        return decode_fields(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(bus, "decode_fields", counting)
    turns = 0  # how often another task got the loop

    async def other() -> None:
        nonlocal turns
        while True:
            turns += 1
            await asyncio.sleep(0)

    reader = GroupReader(bus, "decisions", "g", "c", Decision)
    chunks = reader.chunks(4)
    task = asyncio.create_task(other())
    try:
        seen: list[tuple[list[str], int, int]] = []  # (ids, decoded, turns) per chunk
        async for chunk in chunks:
            seen.append(([e.id for e in chunk], decoded, turns))
            if len(seen) == 3:
                break
        assert [ids for ids, _, _ in seen] == [ids[:4], ids[4:8], ids[8:]]  # the bad one left out
        assert [n for _, n, _ in seen] == [4, 8, 12]  # each chunk decoded when it is reached
        assert seen[0][2] < seen[1][2] < seen[2][2]  # the other task ran between chunks
        assert await bus.redis.xlen(bus.keys.dead) == 1
        assert await reader.pending() == 11  # good entries wait for the whole batch
    finally:
        task.cancel()
    # Asking for the next batch acknowledges this one.
    more = asyncio.ensure_future(anext(chunks))
    for _ in range(100):
        if await reader.pending() == 0:
            break
        await asyncio.sleep(0.01)
    more.cancel()
    assert await reader.pending() == 0


async def test_stale_pending_entries_are_reclaimed(bus: Bus) -> None:
    fast = bus_settings(prefix=bus.keys.prefix, claim_idle_ms=50, block_ms=50)
    b2 = Bus(bus.redis, fast, bus.redis_settings)
    entry = await bus.publish("reports", decision(1))
    dead_consumer = GroupReader(b2, "reports", "sched", "crashed", Decision)
    assert [e.id for e in await dead_consumer.read()] == [entry]  # delivered, never acked
    await asyncio.sleep(0.1)
    survivor = GroupReader(b2, "reports", "sched", "survivor", Decision)
    got = await survivor.read()
    assert [e.id for e in got] == [entry]
    await survivor.ack(entry)
    assert await survivor.pending() == 0


async def test_malformed_entries_go_to_dead_letter_and_reader_continues(bus: Bus) -> None:
    key = bus.keys.decisions
    good1 = await bus.publish("decisions", decision(1))
    await bus.redis.xadd(key, {"kind": "decision", "body": b"\xc1 not msgpack"})
    await bus.redis.xadd(key, {"kind": "decision"})  # no body
    still_valid = encode(decision(2)).replace(b"current", b"CURRENT")  # mode is free text
    await bus.redis.xadd(key, {"body": msgpack.packb({"v": 99, "k": "decision"})})
    await bus.redis.xadd(key, {"body": msgpack.packb({"v": 1, "k": "decision", "id": 3})})
    await bus.redis.xadd(key, {"body": still_valid})
    good2 = await bus.publish("decisions", decision(3))

    reader = GroupReader(bus, "decisions", "g", "c", Decision)
    got = await reader.read()
    assert got[0].id == good1 and got[-1].id == good2
    assert len(got) == 3
    # bad entries are acknowledged, never delivered again
    await reader.ack(*(e.id for e in got))
    assert await reader.pending() == 0

    dead = [parse_dead(i.decode(), f) for i, f in await bus.redis.xrange(bus.keys.dead)]
    assert len(dead) == 4
    reasons = " | ".join(d.reason for d in dead)
    assert "not msgpack" in reasons
    assert "no 'body'" in reasons
    assert "schema version 99" in reasons
    assert "decision.id: expected str" in reasons
    assert all(d.stream == key for d in dead)

    # An ordered subscriber over the same stream does not duplicate dead letters.
    sub = Subscriber(bus, "decisions", Decision, start="0")
    assert len(await sub.read()) == 3
    assert await bus.redis.xlen(bus.keys.dead) == 4


async def test_subscriber_sees_every_entry_in_order(bus: Bus) -> None:
    await bus.publish("events", Event.now(EventKind.WORKER_UP, "w0"))
    sub = Subscriber(bus, "events", Event)  # "$": only what comes after now
    assert await sub.read(block_ms=20) == []

    async def producer() -> list[str]:
        out = []
        for i in range(200):
            out.append(await bus.publish("events", Event.now(EventKind.FINISHED, "p", request=f"r{i}")))
        return out

    task = asyncio.create_task(producer())
    seen: list[str] = []
    while len(seen) < 200:
        seen.extend(e.id for e in await sub.read(block_ms=200))
    assert seen == await task


async def test_load_hash_roundtrip_and_bad_values_skipped(bus: Bus) -> None:
    entries = [LoadEntry(f"d{i}", "decode", f"127.0.0.1:{9000 + i}", 10 * i, 1000, 1.5 * i, i, time.time()) for i in range(3)]
    await bus.publish_load(entries, ttl_s=5)
    await bus.redis.hset(bus.keys.load, "broken", b"garbage")
    view = await bus.read_load()
    assert sorted(view) == ["d0", "d1", "d2"]
    assert view["d2"].tokens == 20


async def test_readers_survive_redis_kill_and_restart(own_redis: RedisServer) -> None:
    """Consumer group and ordered subscriber across a SIGKILL + restart:
    nothing lost, nothing acknowledged delivered twice."""
    rs = redis_settings(own_redis)
    bs = bus_settings(block_ms=100)
    producer_bus = Bus.from_settings(rs, bs)
    reader_bus = Bus.from_settings(rs, bs)
    sub_bus = Bus.from_settings(rs, bs)
    reader = GroupReader(reader_bus, "reports", "sched", "c1", Decision)
    sub = Subscriber(sub_bus, "reports", Decision, start="0")
    published: list[str] = []
    processed: list[str] = []
    subscribed: list[str] = []
    done = asyncio.Event()

    async def produce() -> None:
        for i in range(60):
            published.append(await producer_bus.publish("reports", decision(i)))
            await asyncio.sleep(0.01)

    async def consume() -> None:
        while not done.is_set() or len(processed) < len(published):
            for e in await reader.read(block_ms=50):
                processed.append(e.id)
                await reader.ack(e.id)

    async def follow() -> None:
        while not done.is_set() or len(subscribed) < len(published):
            subscribed.extend(e.id for e in await sub.read(block_ms=50))

    tasks = [asyncio.create_task(consume()), asyncio.create_task(follow())]
    first = asyncio.create_task(produce())
    await asyncio.sleep(0.25)
    await asyncio.to_thread(own_redis.kill)
    await asyncio.sleep(0.3)
    await asyncio.to_thread(own_redis.start)
    await first
    done.set()
    await asyncio.wait_for(asyncio.gather(*tasks), 20)
    try:
        assert len(published) == 60
        assert processed == published  # every entry exactly once, in order
        assert subscribed == published
        assert await reader.pending() == 0
    finally:
        for b in (producer_bus, reader_bus, sub_bus):
            await b.close()


async def test_reader_gives_up_after_reconnect_timeout(own_redis: RedisServer) -> None:
    b = Bus.from_settings(redis_settings(own_redis, reconnect_timeout_s=0.5), bus_settings())
    sub = Subscriber(b, "events", Event, start="0")
    await sub.read(block_ms=10)
    own_redis.kill()
    started = time.monotonic()
    with pytest.raises(BusUnavailable, match="unreachable"):
        await sub.read(block_ms=10)
    assert time.monotonic() - started < 10  # reconnect_timeout_s=0.5, not the fixture's 15 s
    await b.close()


async def test_report_roundtrip_over_the_bus(bus: Bus) -> None:
    from star.wire import RequestLoad

    report = Report(
        instance="decode-0", role="decode", seq=7, ts=time.time(), address="127.0.0.1:1",
        capacity_tokens=1000, used_tokens=30, bytes_per_token=4096, step_time_s=0.01, delta=32,
        trace=[30.0, 20.0], requests=[RequestLoad("r1", 30, 10, 12.5)],
    )
    await bus.publish("reports", report)
    got = await GroupReader(bus, "reports", "g", "c", Report).read()
    assert got[0].msg == report
    assert got[0].fields["instance"] == "decode-0"


async def test_publish_retry_after_lost_reply_does_not_duplicate(bus: Bus) -> None:
    """The XADD reaches Redis but the connection breaks before the reply."""
    from redis.exceptions import ConnectionError as RedisConnectionError

    real_xadd = bus.redis.xadd
    calls = 0

    async def flaky_xadd(*args: object, **kwargs: object) -> object:
        nonlocal calls
        calls += 1
        result = await real_xadd(*args, **kwargs)  # type: ignore[arg-type]
        if calls == 1:
            raise RedisConnectionError("connection reset after write")
        return result

    bus.redis.xadd = flaky_xadd  # type: ignore[method-assign]
    entry = await bus.publish("decisions", decision(1))
    assert calls == 1  # the retry found the entry instead of re-sending
    rows = await bus.redis.xrange(bus.keys.decisions)
    assert [r[0].decode() for r in rows] == [entry]


async def test_request_events_are_one_requests_events_in_order(bus: Bus) -> None:
    await bus.publish("events", Event(EventKind.DISPATCHED, 1.0, "proxy:p", request="a", instance="d0"))
    await bus.publish("events", Event(EventKind.DISPATCHED, 2.0, "proxy:p", request="b", instance="d1"))
    await bus.redis.xadd(bus.keys.stream("events"), {"kind": "event", "body": b"\xc1 not msgpack"})
    await bus.redis.xadd(bus.keys.stream("events"), {"kind": "event"})  # no body
    await bus.publish("events", Event(EventKind.FINISHED, 3.0, "proxy:p", request="a", instance="d0"))
    got = await bus.request_events("a")
    assert [(e.event, e.ts) for e in got] == [(EventKind.DISPATCHED, 1.0), (EventKind.FINISHED, 3.0)]
    assert await bus.request_events("nobody") == []
