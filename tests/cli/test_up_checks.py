"""``star up`` refuses what cannot work, in one line: a cluster already on its bus, a bad setting.

A second ``star up`` on the machine's Redis and prefix would join the first
one's bus (each scheduler and proxy steering the other's workers); it names
the running cluster and exits instead. A worker that cannot start (too
little KV cache for one request) says why in one line naming the setting,
and ``star up`` repeats that line and exits non-zero. On Sentinels whose
master does not answer it says so and starts nothing.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import time
import uuid
from pathlib import Path

import pytest

from star.bus import Bus
from star.fleet import live_cluster
from star.wire import Event, EventKind
from tests.conftest import bus_settings, redis_settings
from tests.procs import cluster_env, reaper
from tests.redis_server import RedisServer
from tests.reports import report


async def test_live_cluster_is_a_leader_or_a_worker_that_reported_and_did_not_leave(
    bus: Bus,
) -> None:
    assert await live_cluster(bus, 5.0) is None
    await bus.publish("reports", report("decode-0"))
    await bus.publish("reports", report("prefill-0", role="prefill"))
    assert await live_cluster(bus, 5.0) == "workers decode-0, prefill-0"
    await bus.redis.set(bus.keys.leader, "scheduler-0|7", px=5000)
    assert (
        await live_cluster(bus, 5.0) == "scheduler leader scheduler-0, workers decode-0, prefill-0"
    )
    await bus.redis.delete(bus.keys.leader)  # a scheduler that stops lets go of the lock
    down = Event(EventKind.WORKER_DOWN, time.time(), "decode-0", instance="decode-0")
    await bus.publish("events", down)
    assert await live_cluster(bus, 5.0) == "workers prefill-0"
    await bus.publish("reports", report("decode-0", seq=2))  # it came back
    assert await live_cluster(bus, 5.0) == "workers decode-0, prefill-0"
    await asyncio.sleep(0.02)  # the newest report is now older than 1 ms, whatever the box's speed
    assert await live_cluster(bus, 0.001) is None  # reports that old are a dead cluster's


def test_a_second_star_up_on_a_live_bus_refuses_naming_it(
    redis_server: RedisServer, tmp_path: Path
) -> None:
    prefix = f"t{uuid.uuid4().hex[:8]}"

    async def first_cluster(up: bool) -> None:
        bus = Bus.from_settings(redis_settings(redis_server), bus_settings(prefix=prefix))
        try:
            if up:
                await bus.redis.set(bus.keys.leader, "scheduler-0|1", px=60_000)
                await bus.publish("reports", report("decode-0"))
            else:
                await bus.redis.delete(bus.keys.leader)
        finally:
            await bus.close()

    asyncio.run(first_cluster(up=True))
    try:
        env = {**cluster_env(), "STAR_REDIS_URL": redis_server.url, "STAR_BUS_PREFIX": prefix}
        run_dir = tmp_path / "second"
        out = _star_up(run_dir, env)
    finally:
        asyncio.run(first_cluster(up=False))
    assert out.returncode == 2, out.stderr
    assert out.stderr.strip().splitlines() == [
        f"star: error: a cluster is already running on {redis_server.url} with prefix "
        f"'{prefix}' (scheduler leader scheduler-0, workers decode-0); pass --set "
        "bus.prefix=NAME to start another beside it, or stop that one first"
    ]
    assert not run_dir.exists()  # nothing was started


def _star_up(run_dir: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """``star up`` on a free port with its logs in ``run_dir``, for a refusal it must print."""
    return subprocess.run(
        ["star", "up", "--port", "0", "--run-dir", str(run_dir)],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )


def test_star_up_says_when_no_sentinel_answers_and_starts_nothing(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    env = {**cluster_env(), "STAR_REDIS_SENTINELS": "127.0.0.1:1", "STAR_REDIS_SERVICE_NAME": "s"}
    out = _star_up(run_dir, env)
    assert out.returncode == 2, out.stderr
    line = out.stderr.strip()
    assert "\n" not in line
    assert line.startswith("star: error: no Redis answers as master 's' of Sentinels 127.0.0.1:1: ")
    assert "unset redis.sentinels" in line
    assert not run_dir.exists()  # nothing was started


@pytest.mark.engine
def test_up_with_too_little_kv_cache_says_so_in_one_line(
    redis_server: RedisServer, tmp_path: Path
) -> None:
    """Two real engines start (~30-60 s of CPU here) and fail vLLM's KV check."""
    run_dir = tmp_path / "run"
    with reaper(str(tmp_path)) as mark:
        env = {
            **cluster_env(**mark),
            "STAR_REDIS_URL": redis_server.url,
            "STAR_BUS_PREFIX": f"t{uuid.uuid4().hex[:8]}",
        }
        started = time.monotonic()
        out = subprocess.run(
            [
                "star",
                "up",
                "--decode",
                "1",
                "--port",
                "0",
                "--run-dir",
                str(run_dir),
                "--set",
                "worker.kv_cache_space_gib=0.004",
            ],
            capture_output=True,
            text=True,
            timeout=280,
            env=env,
            cwd=tmp_path,
        )
    took = time.monotonic() - started
    assert out.returncode == 1, (out.stdout, out.stderr)
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr
    says = (
        "the engine did not start: the KV cache (worker.kv_cache_space_gib=0.004) is too small "
        "for one request of worker.max_model_len=4096 tokens"
    )
    assert (
        says in lines[0]
        and "raise worker.kv_cache_space_gib or lower worker.max_model_len" in lines[0]
    )
    assert lines[0].startswith("star up: ") and " exited with status 1: " in lines[0]
    assert took < 250
    # The worker's own log: that line once, as a JSON line of its own; no
    # traceback with local variables anywhere (they made it 200 kB).
    name = lines[0].removeprefix("star up: ").split()[0]
    log = (run_dir / f"{name}.log").read_text()
    entries = [json.loads(line) for line in log.splitlines() if line.startswith("{")]
    failed = [e for e in entries if e.get("event") == "startup_failed"]
    assert len(failed) == 1 and says in failed[0]["error"] and "exception" not in failed[0]
    assert len(log) < 50_000 and '"locals"' not in log
