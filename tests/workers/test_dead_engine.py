"""A worker whose engine dies stops reporting, announces ``worker_down`` and exits 1.

Fresh reports of a dead engine would keep its instance a dispatch and
migration target (the scheduler drops an instance on ``worker_down``:
tests/scheduler/test_worker_down.py). The worker here is the real
:class:`WorkerService` on a real redis-server, with a stand-in engine and token
server instead of vLLM (tests/workers/test_engine.py runs the real ones).
"""

from __future__ import annotations

import asyncio
import contextlib
import warnings
from collections.abc import AsyncIterator
from typing import Any

from star.bus import Bus
from star.settings import Settings, WorkerSettings
from star.wire import Event, EventKind, Report, decode
from tests.conftest import bus_settings, redis_settings
from tests.redis_server import RedisServer
from workers.pacing import StepTimes
from workers.state import EngineStats

with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # vLLM's import-time warnings
    from workers.service import WorkerService

WITHIN_S = 60.0  # bounds a wait for something that must happen, on a loaded box


class DyingEngine:
    """Reports like an idle engine; ``die()`` is what vLLM's errored flag turning on looks like."""

    def __init__(self) -> None:
        self.dead = False
        self.waits = 0
        self.shut_down = False

    def die(self) -> None:
        self.dead = True

    async def wait_decode_steps(self, n: int, max_wait_s: float) -> int:
        self.waits += 1
        await asyncio.sleep(max_wait_s)
        return 0

    def stats(self) -> EngineStats:
        # The real one too reads its own counters, dead engine or not.
        return EngineStats(
            ts=0.0,
            block_size=16,
            num_blocks=100,
            bytes_per_token=1024,
            kv_usage=0.0,
            running=(),
            waiting=0,
            steps=0,
            decode_steps=0,
            decode_time_s=0.0,
            preemptions=0,
        )

    async def predictions(self) -> dict[str, float]:
        return {}

    async def step_times(self) -> StepTimes:
        return StepTimes()  # no model step ran

    async def shutdown(self) -> None:
        self.shut_down = True


class IdleServer:
    address = "127.0.0.1:1"
    refused = 0  # TokenServer.refused: peers that failed the handshake

    async def shutdown(self, drain_timeout: float) -> None:
        pass


class Worker(WorkerService):
    """The real service with the stand-ins installed instead of starting vLLM."""

    async def startup(self) -> None:
        self.bus = Bus.from_settings(self.settings.redis, self.settings.bus)
        self.engine = DyingEngine()  # type: ignore[assignment]
        self.server = IdleServer()  # type: ignore[assignment]


async def entries(bus: Bus, stream: str) -> list[Any]:
    return [decode(raw[b"body"]) for _id, raw in await bus.tail(stream, 1000)]


async def reports(bus: Bus) -> list[Report]:
    return [m for m in await entries(bus, "reports") if isinstance(m, Report)]


def worker_settings(redis_server: RedisServer, **worker: Any) -> Settings:
    return Settings(
        redis=redis_settings(redis_server), bus=bus_settings(), worker=WorkerSettings(**worker)
    )


@contextlib.asynccontextmanager
async def serving(
    worker: WorkerService,
) -> AsyncIterator[tuple[asyncio.Task[int], Bus]]:
    """``worker`` serving (no token server), and a bus on its Redis; both stopped on exit."""
    worker.sock.close()  # no token server here
    task = asyncio.create_task(worker.serve(install_signals=False))
    bus = Bus.from_settings(worker.settings.redis, worker.settings.bus)
    try:
        yield task, bus
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await bus.close()


async def test_a_dead_engine_stops_the_reports_and_the_worker(redis_server: RedisServer) -> None:
    worker = Worker(
        worker_settings(
            redis_server, instance="decode-x", report_interval_s=0.05, drain_timeout_s=1.0
        )
    )
    async with serving(worker) as (task, bus):
        async with asyncio.timeout(WITHIN_S):
            while len(await reports(bus)) < 2:  # noqa: ASYNC110 (state in Redis)
                await asyncio.sleep(0.02)
        assert isinstance(worker.engine, DyingEngine)
        worker.engine.die()
        async with asyncio.timeout(10):  # 200 report intervals
            status = await asyncio.shield(task)
        assert status == 1  # a failed worker, for systemd / star up to notice
        got = await reports(bus)
        events = [m for m in await entries(bus, "events") if isinstance(m, Event)]
        assert [(e.event, e.instance) for e in events] == [(EventKind.WORKER_DOWN, "decode-x")]
        assert all(r.ts < events[0].ts for r in got)  # nothing reported after it
        assert worker.engine.shut_down
