"""A proxy with ``cluster.secret`` on a real Redis: a forged report never reaches its
directory (nor moves an instance's address), a forged decision never reaches the
migrator, a forged load view or policy is not followed."""

from __future__ import annotations

import asyncio
import contextlib
import time

import msgspec

from proxy.cluster import Directory
from proxy.decode_run import follow_decisions
from star.bus import Bus
from star.bus.metrics import RefusalCollector
from star.wire import Decision, LoadEntry, encode
from tests.proxy.fakes import Recorder
from tests.scheduler.reports import report

SECRET = "s3cret-of-this-cluster"


def signed(bus: Bus, secret: str) -> Bus:
    return Bus(bus.redis, bus.settings, bus.redis_settings, secret)


async def test_forged_reports_are_ignored_by_the_directory(bus: Bus) -> None:
    genuine, proxy_bus = signed(bus, SECRET), signed(bus, SECRET)
    await genuine.publish("reports", report("decode-0", [10]))
    real = (await proxy_bus.latest_reports())["decode-0"].address
    forged = msgspec.structs.replace(report("decode-0", [10], seq=2), address="6.6.6.6:1")
    await bus.publish("reports", forged)  # unsigned
    await signed(bus, "not-the-secret").publish("reports", forged)
    await bus.publish("reports", report("decode-9", [10]))  # an instance that does not exist
    await genuine.publish("reports", report("decode-1", [10]))
    directory = Directory(proxy_bus, staleness_s=60)
    task = asyncio.create_task(directory.follow_reports())
    try:
        deadline = time.monotonic() + 10
        while len(directory.members("decode")) < 2 and time.monotonic() < deadline:  # noqa: ASYNC110
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.3)
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    members = {m.instance: m.address for m in directory.members("decode")}
    assert members == {"decode-0": real, "decode-1": members["decode-1"]}
    assert directory.pick("decode", "round-robin", 10).address != "6.6.6.6:1"
    assert directory.pick("decode", "round-robin", 10).address != "6.6.6.6:1"
    [family] = RefusalCollector(proxy_bus.refusals).collect()
    assert {s.labels["reason"]: s.value for s in family.samples} == {
        "unsigned": 2,
        "bad_signature": 1,
    }


async def test_forged_decisions_are_never_applied(bus: Bus) -> None:
    genuine = signed(bus, SECRET)
    now = time.time()

    def decision(id: str, fence: int = 0) -> Decision:
        return Decision(id, "r-" + id, "d0", "d1", 0, -1.0, "manual", now, fence)

    await bus.publish("decisions", decision("unsigned", 99))
    await signed(bus, "not-the-secret").publish("decisions", decision("wrong-key", 99))
    body = encode(decision("tampered"))
    sig = genuine.signer.sign(bus.keys.decisions, body)  # type: ignore[union-attr]
    await bus.redis.xadd(
        bus.keys.decisions, {"body": body.replace(b"d1", b"d6"), "sig": sig}
    )  # a bit changed
    await genuine.publish("decisions", decision("real"))
    migrator = Recorder()
    proxy_bus = signed(bus, SECRET)
    follower = asyncio.create_task(follow_decisions(proxy_bus, migrator, 15.0, start="0-0"))
    try:
        deadline = time.monotonic() + 10
        while not migrator.applied and time.monotonic() < deadline:  # noqa: ASYNC110
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.3)
    finally:
        follower.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await follower
    assert migrator.applied == ["real"]
    assert await bus.redis.xlen(bus.keys.dead) == 3


async def test_a_forged_load_view_is_not_followed(bus: Bus) -> None:
    genuine = signed(bus, SECRET)
    entry = LoadEntry("decode-0", "decode", "127.0.0.1:9000", 10, 1000, 1.0, 1, time.time())
    await genuine.publish_load([entry], ttl_s=5, policy="round-robin")
    directory = Directory(signed(bus, SECRET), staleness_s=60)
    await directory.refresh()
    assert [m.address for m in directory.members("decode")] == ["127.0.0.1:9000"]
    assert directory.policy("current-load") == "round-robin"

    evil = msgspec.structs.replace(entry, address="6.6.6.6:1")
    await bus.redis.hset(bus.keys.load, "decode-0", encode(evil))
    await bus.redis.set(bus.keys.dispatch, "predicted")
    fresh = Directory(signed(bus, SECRET), staleness_s=60)
    await fresh.refresh()
    assert fresh.members("decode") == []  # nothing followed: no view, no reports
    assert fresh.policy("current-load") == "current-load"
