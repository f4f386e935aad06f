"""The scheduler's report intake yields to the event loop inside a large batch."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

import pytest

from scheduler import service
from scheduler.service import REPORTS_PER_YIELD, SchedulerService
from star.settings import Settings
from star.wire import Report
from tests.scheduler.reports import report

BATCH = 3 * REPORTS_PER_YIELD + 5


class OneBatch:
    """A GroupReader stand-in that delivers one batch of BATCH reports, then ends."""

    def __init__(self, *_args: Any, **_kwargs: Any) -> None:
        pass

    async def __aiter__(self) -> AsyncIterator[list[SimpleNamespace]]:
        yield [SimpleNamespace(msg=report(f"d{i}", [10, 20])) for i in range(BATCH)]


async def test_a_large_batch_lets_other_tasks_run_between_chunks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(service, "GroupReader", OneBatch)
    svc = SchedulerService(Settings(), node="test")
    svc.bus = object()  # type: ignore[assignment]  # the stand-in reader never uses it
    turns = 0  # how often another task (a tick, the lock renewal) got the loop

    async def other() -> None:
        nonlocal turns
        while True:
            turns += 1
            await asyncio.sleep(0)

    seen_at: list[int] = []
    observe = svc.accuracy.observe

    def spy(r: Report, now: float | None = None) -> None:
        seen_at.append(turns)
        observe(r, now)

    monkeypatch.setattr(svc.accuracy, "observe", spy)
    task = asyncio.create_task(other())
    try:
        await svc._reports()
    finally:
        task.cancel()
    assert len(svc.view.seen) == BATCH and len(seen_at) == BATCH  # every report applied
    chunks = [seen_at[i : i + REPORTS_PER_YIELD] for i in range(0, BATCH, REPORTS_PER_YIELD)]
    assert all(len(set(c)) == 1 for c in chunks)  # no yield inside a chunk
    assert all(a[0] < b[0] for a, b in itertools.pairwise(chunks))  # the other task ran between
