"""The installed `star` command, as an operator runs it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import msgspec

from star.bus import Bus
from star.ports import listen
from star.wire import Decision, Event, EventKind
from tests.conftest import bus_settings, redis_settings
from tests.redis_server import RedisServer
from tests.reports import report


def star(
    *args: str, env: dict[str, str] | None = None, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["star", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )


def test_help_lists_commands() -> None:
    out = star("--help")
    assert out.returncode == 0
    assert "config" in out.stdout and "inspect" in out.stdout


def test_config_show_reports_sources(tmp_path: Path) -> None:
    cfg = tmp_path / "star.toml"
    cfg.write_text("[scheduler]\ninterval_s = 0.5\n")
    out = star(
        "config",
        "show",
        "--config",
        str(cfg),
        "--set",
        "proxy.port=9100",
        env={"STAR_SCHEDULER_THETA": "0.25", "STAR_PROXY_API_KEY": "sekret"},
    )
    assert out.returncode == 0, out.stderr
    lines = {line.split("=")[0].strip(): line for line in out.stdout.splitlines()}
    assert "0.5" in lines["scheduler.interval_s"] and f"file {cfg}" in lines["scheduler.interval_s"]
    assert "env STAR_SCHEDULER_THETA" in lines["scheduler.theta"]
    assert "9100" in lines["proxy.port"] and "# flag" in lines["proxy.port"]
    assert "sekret" not in out.stdout and "***" in lines["proxy.api_key"]


def test_config_show_json_and_bad_value() -> None:
    out = star("config", "show", "--json")
    assert json.loads(out.stdout)["scheduler"]["interval_s"] == 0.25
    bad = star("config", "show", "--set", "scheduler.interval_s=-3")
    assert bad.returncode == 2
    assert "scheduler.interval_s: must be > 0, got -3.0 (from flag)" in bad.stderr
    assert "Traceback" not in bad.stderr


async def test_inspect_prints_decoded_entries_and_dead_letters(redis_server: RedisServer) -> None:
    bs = bus_settings()
    bus = Bus.from_settings(redis_settings(redis_server), bs)
    await bus.publish(
        "decisions",
        Decision("m1", "cmpl-9", "decode-0", "decode-2", 4, -12.5, "predicted", time.time()),
    )
    await bus.publish(
        "events",
        Event(EventKind.RELEASED, time.time(), "decode-0", request="cmpl-9", migration="m1"),
    )
    await bus.dead_letter(bus.keys.decisions, "1-1", "not msgpack", b"\x00")
    await bus.close()
    env = {"STAR_REDIS_URL": redis_server.url, "STAR_BUS_PREFIX": bs.prefix}

    out = star("inspect", "decisions", env=env)
    assert out.returncode == 0, out.stderr
    assert "move cmpl-9 decode-0 -> decode-2" in out.stdout and "mode=predicted" in out.stdout

    out = star("inspect", "events", "--json", env=env)
    row = json.loads(out.stdout.splitlines()[0])
    assert row["event"] == "released" and row["request"] == "cmpl-9"

    out = star("inspect", "dead", env=env)
    assert "not msgpack" in out.stdout


async def test_status_shows_a_draining_instance(redis_server: RedisServer) -> None:
    bs = bus_settings()
    bus = Bus.from_settings(redis_settings(redis_server), bs)
    await bus.publish("reports", msgspec.structs.replace(report("decode-0"), draining=True))
    await bus.publish("reports", report("decode-1"))
    await bus.close()
    env = {"STAR_REDIS_URL": redis_server.url, "STAR_BUS_PREFIX": bs.prefix}

    out = star("status", "--json", env=env)
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert {i["instance"]: i["draining"] for i in doc["instances"]} == {
        "decode-0": True,
        "decode-1": False,
    }
    out = star("status", env=env)
    lines = {
        line.split()[0]: line for line in out.stdout.splitlines() if line.startswith("decode-")
    }
    assert lines["decode-0"].endswith("DRAINING") and "DRAINING" not in lines["decode-1"]


async def test_status_shows_refused_token_protocol_peers(redis_server: RedisServer) -> None:
    bs = bus_settings()
    bus = Bus.from_settings(redis_settings(redis_server), bs)
    await bus.publish("reports", msgspec.structs.replace(report("decode-0"), refused_peers=3))
    await bus.publish("reports", report("decode-1"))
    await bus.close()
    env = {"STAR_REDIS_URL": redis_server.url, "STAR_BUS_PREFIX": bs.prefix}

    doc = json.loads(star("status", "--json", env=env).stdout)
    assert {i["instance"]: i["refused_peers"] for i in doc["instances"]} == {
        "decode-0": 3,
        "decode-1": 0,
    }
    out = star("status", env=env)
    lines = {
        line.split()[0]: line for line in out.stdout.splitlines() if line.startswith("decode-")
    }
    assert lines["decode-0"].endswith("REFUSED 3 PEERS") and "REFUSED" not in lines["decode-1"]


def test_inspect_follow_streams_new_entries(redis_server: RedisServer) -> None:
    bs = bus_settings()
    env = {**os.environ, "STAR_REDIS_URL": redis_server.url, "STAR_BUS_PREFIX": bs.prefix}
    proc = subprocess.Popen(
        ["star", "inspect", "events", "--follow"], stdout=subprocess.PIPE, text=True, env=env
    )
    try:
        import asyncio

        async def publish() -> None:
            bus = Bus.from_settings(redis_settings(redis_server), bs)
            await asyncio.sleep(1.0)
            await bus.publish("events", Event(EventKind.WORKER_UP, time.time(), "decode-7"))
            await bus.close()

        asyncio.run(publish())
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert "worker_up" in line and "decode-7" in line
    finally:
        proc.terminate()
        proc.wait(5)


def test_inspect_unreachable_redis_is_one_line() -> None:
    out = star(
        "inspect",
        "events",
        env={"STAR_REDIS_URL": "redis://127.0.0.1:1/0", "STAR_REDIS_RECONNECT_TIMEOUT_S": "0.3"},
    )
    assert out.returncode == 2
    assert "unreachable" in out.stderr and "Traceback" not in out.stderr


def test_up_on_a_taken_port_fails_at_once_with_one_line() -> None:
    # star up binds the proxy's port itself before starting anything, so a
    # port in use is reported up front rather than by a proxy dying later.
    with listen("127.0.0.1") as taken:
        port = taken.getsockname()[1]
        out = star("up", "--port", str(port), "--run-dir", "/nonexistent/never-created", timeout=60)
    assert out.returncode == 2, out.stderr
    assert f"proxy port {port}" in out.stderr and "in use" in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1
    assert not Path("/nonexistent/never-created").exists()


def test_proxy_fd_that_is_not_a_socket_is_one_line() -> None:
    out = star("proxy", "--fd", "987")
    assert out.returncode == 2
    assert "--fd 987: not an open socket" in out.stderr


def test_building_the_cli_imports_no_benchmark() -> None:
    """Every `star worker` start builds the parser: benchmarks (and httpx) load only when run."""
    code = (
        "import sys; from star.cli.main import build_parser; build_parser(); "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('benchmarks', 'httpx')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
