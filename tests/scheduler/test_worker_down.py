"""A worker's ``worker_down`` drops its instance from a real ``star scheduler`` at once.

Staleness is set far above the test's waits, so only the event can exclude an
instance whose last report is still fresh: from the dispatch view, and so from
the planner's targets and sources (tests/scheduler/test_view.py).
"""

from __future__ import annotations

import asyncio
import time

from star.bus import Bus, Subscriber
from star.wire import Event, EventKind
from tests.scheduler.conftest import LIGHT, Cluster, wait_for

STALENESS_S = 60.0  # reports stay fresh for the whole test
WITHIN_S = 30.0  # bounds a wait for something that must happen, on a loaded box


async def down(bus: Bus, instance: str) -> None:
    """What a worker publishes as it stops (workers.service)."""
    await bus.publish(
        "events", Event(EventKind.WORKER_DOWN, time.time(), instance, instance=instance)
    )


async def view_becomes(bus: Bus, want: set[str]) -> None:
    deadline = time.monotonic() + WITHIN_S
    while set(view := await bus.read_load()) != want:
        assert time.monotonic() < deadline, f"load view {sorted(view)}, expected {sorted(want)}"
        await asyncio.sleep(0.05)


async def test_worker_down_excludes_an_instance_with_fresh_reports(
    cluster: Cluster, bus: Bus
) -> None:
    cluster.reporting = {"a": LIGHT, "b": LIGHT, "c": LIGHT}
    reporter = asyncio.create_task(cluster.report_forever(bus))
    try:
        await asyncio.sleep(0.5)  # a few reports of each
        # "c" went down before the scheduler started: its reports of the last
        # staleness window are read at start, the event must outweigh them.
        del cluster.reporting["c"]
        await down(bus, "c")
        events = Subscriber(bus, "events", Event, start="0")
        cluster.start("solo", STAR_SCHEDULER_STALENESS_S=str(STALENESS_S))
        await wait_for(
            events, lambda m: isinstance(m, Event) and m.event is EventKind.LEADER, within_s=120
        )
        await view_becomes(bus, {"a", "b"})
        for _ in range(10):  # ten ticks later, still without "c"
            await asyncio.sleep(0.1)
            assert "c" not in await bus.read_load()

        # "b" goes down while the scheduler runs.
        del cluster.reporting["b"]
        await down(bus, "b")
        await view_becomes(bus, {"a"})

        # A worker of the same name starts again: its new reports count.
        cluster.reporting["b"] = LIGHT
        await view_becomes(bus, {"a", "b"})
    finally:
        reporter.cancel()
        await asyncio.gather(reporter, return_exceptions=True)
