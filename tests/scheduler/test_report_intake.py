"""The scheduler's report intake yields to the event loop inside a large batch."""

from __future__ import annotations

import asyncio
import itertools

from scheduler.service import REPORTS_PER_YIELD, SchedulerService
from star.bus import Bus
from star.settings import Settings
from star.wire import Report
from tests.scheduler.reports import report

BATCH = 3 * REPORTS_PER_YIELD + 5


async def test_a_large_batch_lets_other_tasks_run_between_chunks(bus: Bus) -> None:
    for i in range(BATCH):  # one batch: bus.read_count is larger
        await bus.publish("reports", report(f"d{i}", [10, 20]))
    svc = SchedulerService(Settings(), node="test")
    svc.bus = bus
    turns = 0  # how often another task (a tick, the lock renewal) got the loop

    async def other() -> None:
        nonlocal turns
        while True:
            turns += 1
            await asyncio.sleep(0)

    seen_at: list[int] = []
    observe = svc.accuracy.observe
    all_seen = asyncio.Event()

    def spy(r: Report, now: float | None = None) -> None:
        seen_at.append(turns)
        observe(r, now)
        if len(seen_at) == BATCH:
            all_seen.set()

    svc.accuracy.observe = spy  # type: ignore[method-assign]
    tasks = [asyncio.create_task(other()), asyncio.create_task(svc._reports())]
    try:
        await asyncio.wait_for(all_seen.wait(), 10)
    finally:
        for task in tasks:
            task.cancel()
    assert len(svc.view.seen) == BATCH  # every report applied
    chunks = [seen_at[i : i + REPORTS_PER_YIELD] for i in range(0, BATCH, REPORTS_PER_YIELD)]
    assert all(len(set(c)) == 1 for c in chunks)  # no yield inside a chunk
    assert all(a[0] < b[0] for a, b in itertools.pairwise(chunks))  # the other task ran between


async def test_no_report_is_applied_while_a_tick_runs(bus: Bus) -> None:
    for i in range(5):
        await bus.publish("reports", report(f"d{i}", [10, 20]))
    svc = SchedulerService(Settings(), node="test")
    svc.bus = bus
    observe = svc.accuracy.observe
    all_seen = asyncio.Event()

    def spy(r: Report, now: float | None = None) -> None:
        observe(r, now)
        if len(svc.view.seen) == 5:
            all_seen.set()

    svc.accuracy.observe = spy  # type: ignore[method-assign]
    svc._intake_open.clear()  # as _ticks does around run_tick
    task = asyncio.create_task(svc._reports())
    try:
        await asyncio.sleep(0.3)  # read from the stream, held at the gate
        assert not svc.view.seen
        svc._intake_open.set()  # the tick ended
        await asyncio.wait_for(all_seen.wait(), 10)
    finally:
        task.cancel()
