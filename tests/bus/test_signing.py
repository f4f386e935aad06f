"""Signed bus entries (star.bus.signing): with ``cluster.secret`` an entry that is
unsigned, signed with another key, altered or moved to another stream is
dead-lettered, never returned; the load view and the dispatch policy are refused
whole; without a secret nothing changes."""

from __future__ import annotations

import time

import msgspec

from star.bus import Bus, GroupReader, Subscriber, parse_dead
from star.bus.signing import BAD_SIGNATURE, UNSIGNED, WRONG_ROLE, RefusalCounter, Signer
from star.wire import Decision, LoadEntry, Report, encode
from tests.scheduler.reports import report

SECRET = "s3cret-of-this-cluster"


def signed(bus: Bus, secret: str = SECRET) -> Bus:
    """A Bus on the same Redis and prefix as ``bus``, holding ``secret``."""
    return Bus(bus.redis, bus.settings, bus.redis_settings, secret)


def decision(i: int) -> Decision:
    return Decision(f"m{i}", f"r{i}", "d0", "d1", 10, 5.0, "current", time.time(), 1)


def load_entry(i: int) -> LoadEntry:
    return LoadEntry(
        f"d{i}", "decode", f"127.0.0.1:{9000 + i}", 10 * i, 1000, 1.5 * i, i, time.time()
    )


def test_a_tag_covers_the_key_and_every_body_byte() -> None:
    signer, body = Signer(SECRET), encode(report("d0", [10]))
    sig = signer.sign("star:reports", body)
    assert signer.check("star:reports", body, sig) is None
    assert signer.check("star:reports", body, sig.encode()) is None  # as Redis returns it
    assert signer.check("star:decisions", body, sig) == WRONG_ROLE  # replayed elsewhere
    assert signer.check("star:events", body, sig) == BAD_SIGNATURE  # the key is in the tag
    assert signer.check("star:reports", body, None) == UNSIGNED
    assert (
        signer.check("star:reports", body, Signer("other").sign("star:reports", body))
        == BAD_SIGNATURE
    )
    for i in range(len(body)):
        flipped = body[:i] + bytes([body[i] ^ 0x01]) + body[i + 1 :]
        assert signer.check("star:reports", flipped, sig) == BAD_SIGNATURE
    assert signer.check("star:reports", body, b"\xff\xfe") == BAD_SIGNATURE


def test_a_view_tag_is_unambiguous() -> None:
    signer = Signer(SECRET)
    sig = signer.sign_view("k", [(b"a", b"bc")])
    assert signer.check_view("k", [(b"a", b"bc")], sig) is None
    assert signer.check_view("k", [(b"ab", b"c")], sig) == BAD_SIGNATURE
    assert signer.check_view("k", [(b"a", b"bc"), (b"x", b"")], sig) == BAD_SIGNATURE
    assert signer.check_view("k", [], sig) == BAD_SIGNATURE


def test_refusals_are_counted_each_and_logged_once_a_minute() -> None:
    counter = RefusalCounter(every_s=60.0)
    assert counter.refused("k", UNSIGNED, now=0.0) == 1
    assert [counter.refused("k", UNSIGNED, now=t) for t in (1.0, 2.0, 3.0)] == [0, 0, 0]
    assert counter.refused("k", BAD_SIGNATURE, now=4.0) == 1  # its own line
    assert counter.refused("k", UNSIGNED, now=61.0) == 4  # the three held back, and this one
    assert counter.total == {UNSIGNED: 5, BAD_SIGNATURE: 1}


async def test_signed_entries_carry_sig_beside_readable_fields(bus: Bus) -> None:
    sbus = signed(bus)
    entry_id = await sbus.publish("reports", report("d0", [10, 20]))
    [(_id, raw)] = await bus.redis.xrange(bus.keys.reports)
    assert raw[b"kind"] == b"report" and raw[b"instance"] == b"d0"  # redis-cli still reads it
    assert Signer(SECRET).check(bus.keys.reports, raw[b"body"], raw[b"sig"]) is None
    [got] = await Subscriber(sbus, "reports", Report, start="0").read()
    assert got.id == entry_id and isinstance(got.msg, Report)


async def test_forged_altered_and_moved_entries_are_dead_lettered(bus: Bus) -> None:
    sbus = signed(bus)
    key = bus.keys.decisions
    good1 = await sbus.publish("decisions", decision(1))
    await bus.publish("decisions", decision(2))  # unsigned: no secret
    await signed(bus, "another-secret").publish("decisions", decision(3))
    body = encode(decision(4))
    sig = Signer(SECRET).sign(key, body)
    tampered = body.replace(b"d1", b"d9")  # the target changed, the tag kept
    assert tampered != body
    await bus.redis.xadd(key, {"kind": "decision", "body": tampered, "sig": sig})
    rbody = encode(report("d0", [10]))  # a genuine report, replayed as a decision
    await bus.redis.xadd(key, {"body": rbody, "sig": Signer(SECRET).sign(bus.keys.reports, rbody)})
    good2 = await sbus.publish("decisions", decision(5))

    reader = GroupReader(sbus, "decisions", "g", "c", Decision)
    got = await reader.read()
    assert [e.id for e in got] == [good1, good2]
    await reader.ack(*(e.id for e in got))
    assert await reader.pending() == 0  # the refused ones are acknowledged too

    dead = [parse_dead(i.decode(), f) for i, f in await bus.redis.xrange(bus.keys.dead)]
    # The replayed report is tagged by a worker: not a role that writes decisions.
    assert [d.reason for d in dead] == [UNSIGNED, BAD_SIGNATURE, BAD_SIGNATURE, WRONG_ROLE]
    assert all(d.stream == key for d in dead)
    assert dead[2].body == tampered
    assert sbus.refusals.total == {UNSIGNED: 1, BAD_SIGNATURE: 2, WRONG_ROLE: 1}

    # An ordered subscriber sees the same two and buries nothing twice.
    assert [e.id for e in await Subscriber(sbus, "decisions", Decision, start="0").read()] == [
        good1,
        good2,
    ]
    assert await bus.redis.xlen(bus.keys.dead) == 4


async def test_queries_skip_unsigned_entries(bus: Bus) -> None:
    sbus = signed(bus)
    await sbus.publish("reports", report("d0", [10]))
    forged = msgspec.structs.replace(report("d0", [10]), address="6.6.6.6:1")
    await bus.publish("reports", forged)  # newer, unsigned
    latest = await sbus.latest_reports()
    assert latest["d0"].address != "6.6.6.6:1"
    assert (await bus.latest_reports())["d0"].address == "6.6.6.6:1"  # no secret: as before
    rows = await bus.tail("reports", 10)
    assert len(sbus.signed("reports", rows)) == 1 and len(bus.signed("reports", rows)) == 2


async def test_load_view_and_policy_are_signed_whole(bus: Bus) -> None:
    sbus = signed(bus)
    await sbus.publish_load([load_entry(i) for i in range(3)], ttl_s=5, policy="round-robin")
    view, policy = await sbus.read_dispatch()
    assert sorted(view) == ["d0", "d1", "d2"] and policy == "round-robin"

    # A forged instance, an altered one, one removed: the view is refused whole.
    for forge in (
        lambda: bus.redis.hset(bus.keys.load, "evil", encode(load_entry(7))),
        lambda: bus.redis.hset(bus.keys.load, "d1", encode(load_entry(8))),
        lambda: bus.redis.hdel(bus.keys.load, "d2"),
        lambda: bus.redis.hdel(bus.keys.load, "~sig"),
    ):
        await sbus.publish_load([load_entry(i) for i in range(3)], ttl_s=5, policy="round-robin")
        await forge()
        view, policy = await sbus.read_dispatch()
        assert view == {} and policy == "round-robin"
        assert await sbus.read_load() == {}

    await sbus.publish_load([load_entry(0)], ttl_s=5, policy="round-robin")
    await bus.redis.set(bus.keys.dispatch, "current-load")  # a forged policy
    view, policy = await sbus.read_dispatch()
    assert sorted(view) == ["d0"] and policy is None

    # Written without a secret: a reader with one takes nothing.
    await bus.publish_load([load_entry(0)], ttl_s=5, policy="round-robin")
    assert await sbus.read_dispatch() == ({}, None)
    assert sbus.refusals.total[UNSIGNED] >= 2


async def test_without_a_secret_nothing_changes(bus: Bus) -> None:
    entry_id = await bus.publish("decisions", decision(1))
    [(_id, raw)] = await bus.redis.xrange(bus.keys.decisions)
    assert b"sig" not in raw
    [got] = await Subscriber(bus, "decisions", Decision, start="0").read()
    assert got.id == entry_id
    await bus.publish_load([load_entry(0)], ttl_s=5, policy="round-robin")
    assert sorted(await bus.redis.hkeys(bus.keys.load)) == [b"d0"]
    view, policy = await bus.read_dispatch()
    assert sorted(view) == ["d0"] and policy == "round-robin"
    # A reader without a secret takes a signed writer's view too (the tags set aside).
    await signed(bus).publish_load([load_entry(1)], ttl_s=5, policy="round-robin")
    assert sorted((await bus.read_dispatch())[0]) == ["d1"]
