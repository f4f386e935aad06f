"""A Redis outage longer than ``redis.reconnect_timeout_s`` must not stop the proxy.

The proxy holds clients' streams; losing the bus only costs it fresh reports,
the dispatch view and migrations until Redis is back. A real ``star proxy``
process and a real redis-server that is killed and restarted.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from star.bus import Bus
from star.settings import BusSettings
from tests.conftest import redis_settings
from tests.redis_server import RedisServer, free_port
from tests.reports import report

pytestmark = pytest.mark.timeout(600)


def _health(port: int) -> dict[str, object] | None:
    try:
        resp = httpx.get(f"http://127.0.0.1:{port}/health", timeout=5)
        return dict(resp.json())
    except (httpx.HTTPError, ValueError):
        return None


def _wait(
    pred: object, what: str, within_s: float, proc: subprocess.Popen[bytes], log: Path
) -> None:
    deadline = time.monotonic() + within_s
    while not pred():  # type: ignore[operator]
        assert proc.poll() is None, f"proxy exited ({what}):\n" + log.read_text()[-3000:]
        assert time.monotonic() < deadline, f"not {what} within {within_s} s"
        time.sleep(0.3)


async def _announce(server: RedisServer, name: str) -> None:
    bus = Bus.from_settings(redis_settings(server), BusSettings())  # the proxy's default prefix
    try:
        await bus.publish("reports", report(name))
    finally:
        await bus.close()


def test_proxy_outlives_a_redis_outage(own_redis: RedisServer, tmp_path: Path) -> None:
    port = free_port()
    log = tmp_path / "proxy.log"
    env = {
        **os.environ,
        "STAR_REDIS_URL": own_redis.url,
        "STAR_REDIS_RECONNECT_TIMEOUT_S": "1",  # the outage below lasts several of these
        "STAR_SCHEDULER_STALENESS_S": "600",
        "STAR_LOG_FORMAT": "json",
    }
    env.pop("STAR_CONFIG", None)
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "star.cli.main", "proxy", "--port", str(port)],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        _wait(lambda: _health(port) is not None, "listening", 300, proc, log)
        asyncio.run(_announce(own_redis, "decode-before"))
        _wait(
            lambda: "decode-before" in (_health(port) or {}).get("decode", []),  # type: ignore[operator]
            "seeing the first report",
            120,
            proc,
            log,
        )

        own_redis.kill()
        down_until = time.monotonic() + 5  # > 1 s reconnect timeout, several retry rounds
        while time.monotonic() < down_until:
            assert proc.poll() is None, (
                "proxy exited during the outage:\n" + log.read_text()[-3000:]
            )
            time.sleep(0.2)
        assert _health(port) is not None, "proxy stopped answering during the outage"
        assert "unreadable; retrying" in log.read_text()

        own_redis.start()
        asyncio.run(_announce(own_redis, "decode-after"))
        _wait(
            lambda: "decode-after" in (_health(port) or {}).get("decode", []),  # type: ignore[operator]
            "reading reports again after the outage",
            120,
            proc,
            log,
        )
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
