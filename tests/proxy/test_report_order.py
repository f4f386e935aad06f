"""Reports in sequence per incarnation on a real Redis (issue 27): a genuine, signed,
old report copied to the end of ``<prefix>:reports`` moves no address back,
neither in a proxy's directory nor in the scheduler's view."""

from __future__ import annotations

import asyncio
import contextlib
import time

import msgspec

from proxy.cluster import Directory
from scheduler.service import SchedulerService
from star.bus import Bus
from star.settings import ClusterSettings, SchedulerSettings, Settings
from star.wire import Report
from tests.scheduler.reports import report

SECRET = "s3cret-of-this-cluster"
OLD, NEW = "10.0.0.1:7001", "10.0.0.2:7001"


def signed(bus: Bus) -> Bus:
    return Bus(bus.redis, bus.settings, bus.redis_settings, SECRET)


def of(incarnation: int, seq: int, address: str, ts: float) -> Report:
    return msgspec.structs.replace(
        report("decode-0", [10], seq=seq), incarnation=incarnation, address=address, ts=ts
    )


async def _history_then_replay(bus: Bus) -> None:
    """decode-0 ran at OLD (seq up to 40), restarted at NEW (seq 1, 2); then every old
    entry, signature and all, is written again at the end of the stream."""
    worker = signed(bus)
    now = time.time()
    for seq in range(1, 41):
        await worker.publish("reports", of(1, seq, OLD, now - 3 + seq * 0.01))
    await worker.publish("reports", of(2, 1, NEW, now - 1))
    await worker.publish("reports", of(2, 2, NEW, now - 0.5))
    rows = await bus.redis.xrange(bus.keys.reports)
    for _id, fields in rows[:40]:  # a replay: the exact entries, validly signed
        await bus.redis.xadd(bus.keys.reports, fields)


async def _follow(directory: Directory, until: int) -> None:
    task = asyncio.create_task(directory.follow_reports())
    try:
        deadline = time.monotonic() + 10
        while sum(directory.gate.refused.values()) < until and time.monotonic() < deadline:  # noqa: ASYNC110
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.3)
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def test_a_replayed_report_does_not_move_the_address_back(bus: Bus) -> None:
    await _history_then_replay(bus)
    directory = Directory(signed(bus), staleness_s=60)
    await _follow(directory, until=40)
    assert directory.gate.refused == {"retired": 40}
    assert directory.pick("decode", "round-robin", 10).address == NEW
    assert directory.pick("decode", "current-load", 10).address == NEW
    assert directory.address("decode", "decode-0") == NEW


async def test_the_scheduler_view_keeps_the_newest_incarnation(bus: Bus) -> None:
    await _history_then_replay(bus)
    settings = Settings(
        cluster=ClusterSettings(secret=SECRET), scheduler=SchedulerSettings(staleness_s=60.0)
    )
    service = SchedulerService(settings, node="n1")
    service.bus = signed(bus)
    task = asyncio.create_task(service._reports())
    try:
        deadline = time.monotonic() + 10
        while sum(service.report_gate.refused.values()) < 40 and time.monotonic() < deadline:  # noqa: ASYNC110
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.3)
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    assert service.report_gate.refused == {"retired": 40}
    [live] = service.view.live("decode")
    assert (live.address, live.incarnation, live.seq) == (NEW, 2, 2)
