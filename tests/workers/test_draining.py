"""A stopping worker's reports say ``draining`` for as long as its drain lasts.

The scheduler then moves requests off the instance but never onto it, and
leaves it out of the dispatch view (tests/scheduler/test_view.py). The worker
here is the real :class:`WorkerService` on a real redis-server, with the
stand-in engine of tests/workers/test_dead_engine.py and a token server whose
drain lasts until the test ends it.
"""

from __future__ import annotations

import asyncio

from star.bus import Bus
from star.wire import Event, EventKind
from tests.redis_server import RedisServer
from tests.workers.test_dead_engine import (
    WITHIN_S,
    DyingEngine,
    WorkerService,
    entries,
    reports,
    serving,
    worker_settings,
)


class DrainingServer:
    """Open streams finish only when ``finish`` is set (a drain in progress)."""

    address = "127.0.0.1:1"
    refused = 0  # TokenServer.refused: peers that failed the handshake

    def __init__(self) -> None:
        self.draining = asyncio.Event()
        self.finish = asyncio.Event()

    async def shutdown(self, drain_timeout: float) -> None:
        self.draining.set()
        await self.finish.wait()


class Worker(WorkerService):
    async def startup(self) -> None:
        self.bus = Bus.from_settings(self.settings.redis, self.settings.bus)
        self.engine = DyingEngine()  # type: ignore[assignment]
        self.server = DrainingServer()  # type: ignore[assignment]


async def test_reports_say_draining_from_the_stop_until_worker_down(
    redis_server: RedisServer,
) -> None:
    worker = Worker(
        worker_settings(
            redis_server, instance="decode-x", report_interval_s=0.05, drain_timeout_s=30.0
        )
    )
    async with serving(worker) as (task, bus):
        async with asyncio.timeout(WITHIN_S):
            while len(await reports(bus)) < 2:  # noqa: ASYNC110 (state in Redis)
                await asyncio.sleep(0.02)
        assert not any(r.draining for r in await reports(bus))
        worker.request_exit()  # what SIGTERM does
        assert isinstance(worker.server, DrainingServer)
        async with asyncio.timeout(WITHIN_S):
            await worker.server.draining.wait()
            # The drain lasts: reports go on, and say so.
            while sum(r.draining for r in await reports(bus)) < 2:  # noqa: ASYNC110
                await asyncio.sleep(0.02)
        worker.server.finish.set()
        async with asyncio.timeout(WITHIN_S):
            assert await asyncio.shield(task) == 0
        got = await reports(bus)
        flags = [r.draining for r in got]
        first = flags.index(True)
        assert not any(flags[:first]) and all(flags[first:])  # from the stop on, every one
        assert [r.seq for r in got] == sorted(r.seq for r in got)
        events = [m for m in await entries(bus, "events") if isinstance(m, Event)]
        assert [(e.event, e.instance) for e in events] == [(EventKind.WORKER_DOWN, "decode-x")]


async def test_the_first_draining_report_goes_out_when_the_drain_begins(
    redis_server: RedisServer,
) -> None:
    # Reports every 30 s: the drain's start must not wait for the next one.
    worker = Worker(
        worker_settings(
            redis_server, instance="decode-y", report_interval_s=30.0, drain_timeout_s=30.0
        )
    )
    async with serving(worker) as (task, bus):
        async with asyncio.timeout(WITHIN_S):
            while not worker.started:  # noqa: ASYNC110 (the service's own flag)
                await asyncio.sleep(0.02)
        assert await reports(bus) == []  # nothing before the stop: the interval is long
        worker.request_exit()
        async with asyncio.timeout(5.0):  # far under report_interval_s
            while not await reports(bus):  # noqa: ASYNC110 (state in Redis)
                await asyncio.sleep(0.02)
        assert [r.draining for r in await reports(bus)] == [True]
        assert isinstance(worker.server, DrainingServer)
        worker.server.finish.set()
        async with asyncio.timeout(WITHIN_S):
            assert await asyncio.shield(task) == 0
