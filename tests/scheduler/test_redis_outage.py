"""A Redis outage longer than ``redis.reconnect_timeout_s`` must not stop the scheduler.

A real ``star scheduler`` process and a real redis-server that is killed for
several reconnect timeouts and started again: the scheduler stays up, and
once Redis is back it reads the reports published after the restart (through
its consumer group) and publishes the dispatch view again as leader.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from pathlib import Path

import pytest

from star.bus import Bus, Subscriber
from star.wire import Event, EventKind
from tests.conftest import redis_settings
from tests.redis_server import RedisServer
from tests.scheduler.conftest import LIGHT, Cluster, wait_for

pytestmark = pytest.mark.timeout(600)


def start_scheduler(cluster: Cluster, log_path: Path) -> subprocess.Popen[bytes]:
    with log_path.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "star.cli.main", "scheduler", "--node", "solo"],
            # The outage below lasts several of these.
            env=cluster.env(STAR_REDIS_RECONNECT_TIMEOUT_S="0.5"),
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    cluster.procs.append(proc)
    return proc


async def test_scheduler_outlives_a_redis_outage(own_redis: RedisServer, tmp_path: Path) -> None:
    cluster = Cluster(own_redis)
    cluster.reporting = {"a": LIGHT, "b": LIGHT}
    log_path = tmp_path / "scheduler.log"
    proc = start_scheduler(cluster, log_path)

    def tail() -> str:
        return log_path.read_text(errors="replace")[-3000:]

    bus = Bus.from_settings(redis_settings(own_redis), cluster.settings)
    reporter = asyncio.create_task(cluster.report_forever(bus))
    try:
        events = Subscriber(bus, "events", Event, start="0")
        await wait_for(
            events, lambda m: isinstance(m, Event) and m.event is EventKind.LEADER, within_s=120
        )
        deadline = time.monotonic() + 30
        while set(await bus.read_load()) != {"a", "b"}:
            assert time.monotonic() < deadline, f"no load view before the outage:\n{tail()}"
            await asyncio.sleep(0.1)

        reporter.cancel()
        await asyncio.gather(reporter, return_exceptions=True)
        await asyncio.to_thread(own_redis.kill)
        down_until = time.monotonic() + 5  # 10 reconnect timeouts
        while time.monotonic() < down_until:
            assert proc.poll() is None, f"scheduler exited during the outage:\n{tail()}"
            await asyncio.sleep(0.2)
        text = log_path.read_text(errors="replace")
        assert "stream_unreadable" in text, tail()

        await asyncio.to_thread(own_redis.start)
        cluster.reporting = {"a": LIGHT, "c": LIGHT}  # "c" is only ever reported after the restart
        reporter = asyncio.create_task(cluster.report_forever(bus))
        deadline = time.monotonic() + 60
        while "c" not in await bus.read_load():
            assert proc.poll() is None, f"scheduler exited after the outage:\n{tail()}"
            assert time.monotonic() < deadline, f"no report read after the outage:\n{tail()}"
            await asyncio.sleep(0.1)
        assert "stream_readable_again" in log_path.read_text(errors="replace")
    finally:
        reporter.cancel()
        await asyncio.gather(reporter, return_exceptions=True)
        cluster.stop()
        await bus.close()
