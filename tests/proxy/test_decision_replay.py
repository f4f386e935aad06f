"""A proxy following ``<prefix>:decisions`` on a real Redis applies each decision once.

A stream read again from the start (a restored snapshot, a failover to a lagging
replica) repeats every decision; a deposed leader's decision arrives late; an old
one is past its timeout. None of them may reach the migrator twice, or at all.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

from proxy.decode_run import follow_decisions
from star.bus import Bus
from star.wire import Decision
from tests.proxy.fakes import Recorder


def decision(id: str, fence: int, age_s: float = 0.0) -> Decision:
    return Decision(id, "r-" + id, "d0", "d1", 0, -1.0, "predicted", time.time() - age_s, fence)


async def test_a_replayed_stream_applies_nothing_twice(bus: Bus) -> None:
    stream = [decision("a", 1), decision("b", 1), decision("old", 1, age_s=60.0)]
    stream += [decision("c", 2), decision("late", 1)]  # a new leader, then the old one's
    stream += stream  # the stream written again: every decision repeated
    for d in stream:
        await bus.publish("decisions", d)
    migrator = Recorder()
    follower = asyncio.create_task(follow_decisions(bus, migrator, 15.0, start="0-0"))
    try:
        deadline = time.monotonic() + 10
        while len(migrator.applied) < 3 and time.monotonic() < deadline:  # noqa: ASYNC110
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.3)  # whatever else was coming has come
    finally:
        follower.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await follower
    assert migrator.applied == ["a", "b", "c"]
