"""A Redis outage longer than ``redis.reconnect_timeout_s`` must not stop the proxy.

The proxy holds clients' streams; losing the bus only costs it fresh reports,
the dispatch view and migrations until Redis is back. A real ``star proxy``
process and a real redis-server that is killed and restarted.
"""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

import pytest

from star.bus import Bus
from star.settings import BusSettings
from tests.conftest import redis_settings
from tests.procs import proxy_process
from tests.redis_server import RedisServer
from tests.reports import report

pytestmark = pytest.mark.timeout(600)


async def _announce(server: RedisServer, name: str) -> None:
    bus = Bus.from_settings(redis_settings(server), BusSettings())  # the proxy's default prefix
    try:
        await bus.publish("reports", report(name))
    finally:
        await bus.close()


def test_proxy_outlives_a_redis_outage(own_redis: RedisServer, tmp_path: Path) -> None:
    env = {
        **os.environ,
        "STAR_REDIS_URL": own_redis.url,
        "STAR_REDIS_RECONNECT_TIMEOUT_S": "1",  # the outage below lasts several of these
        "STAR_SCHEDULER_STALENESS_S": "600",
        "STAR_LOG_FORMAT": "json",
    }
    env.pop("STAR_CONFIG", None)
    with proxy_process(env, tmp_path / "proxy.log") as proxy:
        asyncio.run(_announce(own_redis, "decode-before"))
        proxy.wait(lambda: "decode-before" in proxy.lists("decode"), "seeing the first report", 120)

        own_redis.kill()
        down_until = time.monotonic() + 5  # > 1 s reconnect timeout, several retry rounds
        while time.monotonic() < down_until:
            assert proxy.proc.poll() is None, f"proxy exited during the outage:\n{proxy.tail()}"
            time.sleep(0.2)
        assert proxy.health() is not None, "proxy stopped answering during the outage"
        assert "stream_unreadable" in proxy.log.read_text()

        own_redis.start()
        asyncio.run(_announce(own_redis, "decode-after"))
        proxy.wait(
            lambda: "decode-after" in proxy.lists("decode"),
            "reading reports again after the outage",
            120,
        )
