"""Real scheduler processes against a real redis-server, fed by a fake-worker reporter."""

from __future__ import annotations

import asyncio
import os
import subprocess
import time
from collections.abc import AsyncIterator, Iterator

import pytest

from star.bus import Bus, Subscriber
from tests.conftest import bus_settings, redis_settings
from tests.redis_server import RedisServer
from tests.scheduler.reports import report

HEAVY = [4000, 3000, 2500, 2000]
LIGHT = [300]


class Cluster:
    """Processes and a fake-worker reporter sharing one bus prefix."""

    def __init__(self, server: RedisServer) -> None:
        self.server = server
        self.settings = bus_settings()
        self.procs: list[subprocess.Popen[bytes]] = []
        self.reporting = {"a": HEAVY, "b": LIGHT, "c": LIGHT}
        self.draining: set[str] = set()  # instances whose reports say draining

    def env(self, **extra: str) -> dict[str, str]:
        return {
            **os.environ,
            "STAR_REDIS_URL": self.server.url,
            "STAR_BUS_PREFIX": self.settings.prefix,
            "STAR_SCHEDULER_INTERVAL_S": "0.1",
            "STAR_SCHEDULER_MODE": "current",
            # Reports come every 0.2 s; a loaded machine can stall the reporter or
            # the scheduler for a second or more, so staleness and the lock TTL
            # leave room (the takeover test sets its own short TTL).
            "STAR_SCHEDULER_STALENESS_S": "3.0",
            "STAR_SCHEDULER_DECISION_TIMEOUT_S": "1.5",
            "STAR_SCHEDULER_LOCK_TTL_S": "5.0",
            "STAR_SCHEDULER_METRICS_PORT": "0",
            "STAR_LOG_FORMAT": "json",
            **extra,
        }

    def start(self, node: str, **env: str) -> subprocess.Popen[bytes]:
        proc = subprocess.Popen(
            ["star", "scheduler", "--node", node],
            env=self.env(**env),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        self.procs.append(proc)
        return proc

    async def report_forever(self, bus: Bus) -> None:
        seq = 0
        while True:
            seq += 1
            for name, loads in list(self.reporting.items()):
                draining = name in self.draining
                await bus.publish("reports", report(name, loads, seq=seq, draining=draining))
            await asyncio.sleep(0.2)

    def stop(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.terminate()
        for p in self.procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()


@pytest.fixture
def cluster(redis_server: RedisServer) -> Iterator[Cluster]:
    c = Cluster(redis_server)
    yield c
    c.stop()


@pytest.fixture
async def bus(cluster: Cluster) -> AsyncIterator[Bus]:
    b = Bus.from_settings(redis_settings(cluster.server), cluster.settings)
    yield b
    await b.close()


async def wait_for(sub: Subscriber, pred: object, within_s: float) -> list[object]:
    deadline = time.monotonic() + within_s
    seen: list[object] = []
    while time.monotonic() < deadline:
        for e in await sub.read(block_ms=100):
            seen.append(e.msg)
            if pred(e.msg):  # type: ignore[operator]
                return seen
    raise AssertionError(f"timed out; saw {seen!r:.2000}")
