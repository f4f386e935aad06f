"""The stat logger's decode-step waits, fed fake step stats (imports vLLM, no engine)."""

from __future__ import annotations

import asyncio
import warnings
from types import ModuleType, SimpleNamespace

import pytest

pytestmark = [
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
]

# Generous: bounds a wait for something that must happen, on a loaded box.
SETTLE_S = 30.0


@pytest.fixture(scope="module")
def eng() -> ModuleType:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # import-time deprecations in torch/vLLM
        import workers.engine_stats

    return workers.engine_stats


def decode_step() -> SimpleNamespace:
    """Scheduler stats of one engine step that decoded."""
    details = SimpleNamespace(is_dummy=False, num_generation_requests=1, elapsed_ms=5.0)
    return SimpleNamespace(
        kv_cache_usage=0.1,
        num_running_reqs=1,
        num_waiting_reqs=0,
        num_skipped_waiting_reqs=0,
        iteration_details=details,
    )


async def test_wait_decode_steps_counts_the_steps(eng: ModuleType) -> None:
    collector = eng.StatsCollector()
    waiting = asyncio.create_task(collector.wait_decode_steps(2, max_wait_s=SETTLE_S))
    await asyncio.sleep(0)
    collector.record(decode_step(), None)
    collector.record(decode_step(), None)
    assert await waiting == 2
    # No step: it returns after max_wait_s with what ran (none).
    assert await collector.wait_decode_steps(1, max_wait_s=0.01) == 0


async def test_a_cancel_landing_as_the_steps_arrive_ends_the_report_loop(eng: ModuleType) -> None:
    """A loop like the worker's report loop ends when cancelled just as a step wakes it.

    The cancel lands after the step resolved the wait but before the waiting
    task resumed: the window in which ``asyncio.wait_for`` loses a cancel
    (:func:`star.aio.deadline` explains), which once hung the worker's shutdown.
    """
    collector = eng.StatsCollector()
    waits = 0

    async def reports() -> None:
        nonlocal waits
        while True:
            waits += 1
            await collector.wait_decode_steps(1, max_wait_s=3600.0)

    task = asyncio.create_task(reports())
    await asyncio.sleep(0)  # the loop runs up to its first wait
    assert waits == 1
    collector.record(decode_step(), None)  # resolves the wait; the task is scheduled to resume
    task.cancel()  # ... and is cancelled before it runs
    done, _ = await asyncio.wait({task}, timeout=SETTLE_S)
    assert done, "the report loop ignored cancel()"
    assert task.cancelled()
    assert waits == 1
