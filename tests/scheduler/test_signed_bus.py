"""A scheduler with ``cluster.secret`` applies only signed reports and books only
signed decisions; the leader's fenced publish is signed like any other."""

from __future__ import annotations

import asyncio
import time

import msgspec

from scheduler.leader import Leadership
from scheduler.service import SchedulerService
from star.bus import Bus, Subscriber
from star.settings import ClusterSettings, Settings
from star.wire import Decision
from tests.scheduler.reports import report

SECRET = "s3cret-of-this-cluster"


def signed(bus: Bus, secret: str) -> Bus:
    return Bus(bus.redis, bus.settings, bus.redis_settings, secret)


def service(bus: Bus) -> SchedulerService:
    svc = SchedulerService(Settings(cluster=ClusterSettings(secret=SECRET)), node="test")
    svc.bus = signed(bus, SECRET)
    return svc


async def test_forged_reports_are_never_applied(bus: Bus) -> None:
    genuine = signed(bus, SECRET)
    await bus.publish("reports", report("forged-unsigned", [10]))
    await signed(bus, "not-the-secret").publish("reports", report("forged-wrong-key", [10]))
    # A genuine instance's report forged: its address moved elsewhere.
    await bus.publish("reports", msgspec.structs.replace(report("d0", [10]), address="6.6.6.6:1"))
    await genuine.publish("reports", report("d0", [10, 20]))
    await genuine.publish("reports", report("d1", [30]))
    svc = service(bus)
    task = asyncio.create_task(svc._reports())
    try:
        deadline = time.monotonic() + 10
        while len(svc.view.seen) < 2 and time.monotonic() < deadline:  # noqa: ASYNC110
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.3)  # whatever else was coming has come
    finally:
        task.cancel()
    assert sorted(svc.view.seen) == ["d0", "d1"]
    assert svc.view.seen["d0"].report.address != "6.6.6.6:1"
    assert await bus.redis.xlen(bus.keys.dead) == 3


async def test_forged_decisions_are_not_booked(bus: Bus) -> None:
    svc = service(bus)
    task = asyncio.create_task(svc._decisions())
    try:
        await asyncio.sleep(0.3)  # the subscriber starts at "$"
        now = time.time()
        await bus.publish(
            "decisions", Decision("forged", "r1", "d0", "d1", 1, -1.0, "current", now, 9)
        )
        await svc.bus.publish(
            "decisions", Decision("real", "r2", "d0", "d1", 1, -1.0, "current", now, 1)
        )  # type: ignore[union-attr]
        deadline = time.monotonic() + 10
        while "real" not in svc.view.in_flight and time.monotonic() < deadline:  # noqa: ASYNC110
            await asyncio.sleep(0.05)
    finally:
        task.cancel()
    assert sorted(svc.view.in_flight) == ["real"]


async def test_the_leaders_fenced_publish_is_signed(bus: Bus) -> None:
    sbus = signed(bus, SECRET)
    leader = Leadership(sbus, "a", ttl_s=5)
    assert await leader.step() is True
    entry = await leader.publish(
        Decision("m", "r", "s", "t", 1, -1.0, "current", time.time(), leader.fence)
    )
    [got] = await Subscriber(sbus, "decisions", Decision, start="0").read()
    assert got.id == entry and isinstance(got.msg, Decision) and got.fields["sig"]
    # A reader with another secret refuses it.
    assert await Subscriber(signed(bus, "other"), "decisions", Decision, start="0").read() == []
