"""``star top`` as an operator runs it: against a real redis-server, in a pipe and in tmux."""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import subprocess
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import msgspec
import pytest

from star.bus import Bus
from star.top.render import EMPTY, FULL, PARTIAL
from star.wire import Decision, Event, EventKind, RequestLoad
from tests.redis_server import RedisServer
from tests.reports import report

BAR = re.compile(f"[{FULL}{EMPTY}{PARTIAL[1:]}]{{4,}}")


async def publish_fleet(bus: Bus) -> None:
    """Two decode instances (one draining), a prefill, a leader, two decisions."""
    now = time.time()
    running = [RequestLoad("cmpl-a", 1500, 40), RequestLoad("cmpl-c", 1000, 9)]
    await bus.publish(
        "reports",
        msgspec.structs.replace(
            report("decode-0", used=2500, requests=running), waiting=1, preemptions=2
        ),
    )
    await bus.publish(
        "reports", msgspec.structs.replace(report("decode-1", used=7500), draining=True)
    )
    await bus.publish("reports", report("prefill-0", role="prefill", used=100))
    await bus.publish(
        "decisions",
        Decision("m-1", "cmpl-a", "decode-1", "decode-0", 7, -4321.0, "predicted", now, fence=3),
    )
    await bus.publish(
        "events", Event(EventKind.RESUMED, now + 0.4, "proxy:p", request="cmpl-a", migration="m-1")
    )
    await bus.publish(
        "decisions",
        Decision(
            "m-2", "cmpl-b", "decode-1", "decode-0", 8, -55.5, "predicted", now, 3, reason="drain"
        ),
    )
    await bus.publish(
        "events", Event(EventKind.RELEASED, now, "decode-1", request="cmpl-b", migration="m-2")
    )
    await bus.redis.set(bus.keys.leader, b"sched-a|3")


def flags(server: RedisServer, bus: Bus) -> list[str]:
    # The reports are published once, and the CLI takes seconds to start on a
    # loaded machine: they must not turn stale (nor the decision unknown) meanwhile.
    return [
        *("--set", f"redis.url={server.url}", "--set", f"bus.prefix={bus.settings.prefix}"),
        *("--set", "scheduler.staleness_s=600", "--set", "scheduler.decision_timeout_s=600"),
    ]


def star_top(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["star", "top", *args], capture_output=True, text=True, timeout=120, env=os.environ.copy()
    )


def fill(line: str) -> float:
    (cells,) = BAR.findall(line)
    eighths = sum(8 if c == FULL else PARTIAL.index(c) for c in cells if c != EMPTY)
    return eighths / (8 * len(cells))


def instance_rows(screen: str) -> dict[str, str]:
    return {
        line.split()[0]: line
        for line in screen.splitlines()
        if line.startswith(("decode-", "prefill-"))
    }


def check_fleet(screen: str) -> None:
    """What the operator must see of :func:`publish_fleet`."""
    assert "leader sched-a (fence 3)  mode predicted" in screen
    rows = instance_rows(screen)
    assert set(rows) == {"decode-0", "decode-1", "prefill-0"}
    assert fill(rows["decode-0"]) == pytest.approx(0.25, abs=0.02)
    assert fill(rows["decode-1"]) == pytest.approx(0.75, abs=0.02)
    assert fill(rows["prefill-0"]) == pytest.approx(0.01, abs=0.02)
    # kv%, used/cap, run, wait, step ms, preempt, state
    assert rows["decode-0"].split()[2:] == ["25%", "2500/10000", "2", "1", "10.0", "2", "ok"]
    assert rows["decode-1"].endswith("DRAINING")
    flight = screen.split("MIGRATIONS IN FLIGHT (1)")[1].split("LAST DECISIONS")[0]
    assert flight.split()[1:] == [
        "released",
        "drain",
        "cmpl-b",
        "decode-1",
        "->",
        "decode-0",
        "m-2",
    ]
    decisions = screen.split("LAST DECISIONS")[1]
    (m1,) = [line for line in decisions.splitlines() if line.endswith("m-1")]
    assert m1.split()[2:] == [
        "resumed", "ΔV", "-4321", "balance", "cmpl-a", "decode-1", "->", "decode-0",
        "in", "0.4s", "m-1",
    ]  # fmt: skip


async def test_once_prints_the_fleet(redis_server: RedisServer, bus: Bus) -> None:
    await publish_fleet(bus)
    out = star_top("--once", "--width", "120", *flags(redis_server, bus))
    assert out.returncode == 0, out.stderr
    assert "\x1b[" not in out.stdout  # a pipe gets no colour
    assert all(len(line) <= 120 for line in out.stdout.splitlines())
    check_fleet(out.stdout)

    narrow = star_top("--once", "--width", "40", *flags(redis_server, bus))
    lines = narrow.stdout.splitlines()
    assert all(len(line) <= 40 for line in lines) and any(line.endswith("…") for line in lines)
    assert fill(instance_rows(narrow.stdout)["decode-1"]) == pytest.approx(0.75, abs=0.13)


async def test_once_json_is_the_model(redis_server: RedisServer, bus: Bus) -> None:
    await publish_fleet(bus)
    out = star_top("--once", "--json", *flags(redis_server, bus))
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert {i["instance"]: (i["kv_fraction"], i["state"]) for i in doc["decode"]} == {
        "decode-0": (0.25, "ok"),
        "decode-1": (0.75, "draining"),
    }
    assert [i["instance"] for i in doc["prefill"]] == ["prefill-0"]
    assert [(d["id"], d["status"], d["delta_v"]) for d in doc["decisions"]] == [
        ("m-2", "released", -55.5),
        ("m-1", "resumed", -4321.0),
    ]
    assert [d["id"] for d in doc["in_flight"]] == ["m-2"]
    assert doc["leader"] == {"node": "sched-a", "fence": 3, "mode": "predicted"}


async def test_a_prefix_with_nothing_on_it_is_an_empty_fleet(
    redis_server: RedisServer, bus: Bus
) -> None:
    await publish_fleet(bus)
    out = star_top(
        "--once", "--set", f"redis.url={redis_server.url}", "--set", "bus.prefix=nobody-here"
    )
    assert out.returncode == 0, out.stderr
    assert "(no reports on the bus)" in out.stdout and "decode-0" not in out.stdout


def test_bad_flags_and_no_redis_are_one_line_errors() -> None:
    out = star_top("--json")
    assert out.returncode == 2 and "--json needs --once" in out.stderr
    out = star_top("--interval", "0")
    assert out.returncode == 2 and "--interval must be > 0" in out.stderr
    out = star_top(
        "--once",
        "--set",
        "redis.url=redis://127.0.0.1:1/0",
        "--set",
        "redis.reconnect_timeout_s=0.5",
    )
    assert out.returncode == 2
    assert out.stderr.strip().splitlines()[-1].startswith("star: error: Redis at")
    assert "Traceback" not in out.stderr


# -- live, in a terminal ------------------------------------------------------------


async def until(ok: Callable[[], bool], what: Callable[[], str]) -> None:
    """Poll ``ok`` for up to 90 s (the CLI starts in seconds, more on a loaded machine)."""
    deadline = time.monotonic() + 90
    while True:
        try:
            if ok():
                return
        except (KeyError, ValueError):  # a frame caught half drawn
            pass
        if time.monotonic() > deadline:
            raise AssertionError(what())
        await asyncio.sleep(0.2)


class Tmux:
    """One private tmux server (its own socket) running a command in a 120x40 pane."""

    def __init__(self, command: str) -> None:
        self.socket = f"star-top-{uuid.uuid4().hex[:8]}"
        self.tmux("new-session", "-d", "-x", "120", "-y", "40", "-s", "top", command)

    def tmux(self, *args: str) -> str:
        cmd = ["tmux", "-L", self.socket, "-f", "/dev/null", *args]
        return subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=30).stdout

    def screen(self) -> str:
        return self.tmux("capture-pane", "-p", "-t", "top")

    async def wait_for(self, ok: Callable[[str], bool]) -> str:
        screens = [""]

        def shows() -> bool:
            screens[0] = self.screen()
            return ok(screens[0])

        await until(shows, lambda: f"the screen never showed it; last screen:\n{screens[0]}")
        return screens[0]

    def close(self) -> None:
        subprocess.run(["tmux", "-L", self.socket, "kill-server"], capture_output=True, timeout=30)


@pytest.mark.skipif(shutil.which("tmux") is None, reason="needs tmux (apt-get install tmux)")
@pytest.mark.parametrize("quit_key", ["q", "C-c"])
async def test_live_view_in_a_terminal_follows_the_bus_and_quits(
    redis_server: RedisServer, bus: Bus, tmp_path: Path, quit_key: str
) -> None:
    await publish_fleet(bus)
    rc = tmp_path / "rc"
    top = Tmux(
        f"star top --interval 0.2 {' '.join(flags(redis_server, bus))}; echo $? > {rc}.tmp; mv {rc}.tmp {rc}"
    )
    try:
        screen = await top.wait_for(lambda s: "LAST DECISIONS" in s and "m-1" in s)
        check_fleet(screen)
        assert len(screen.splitlines()) <= 40
        # colour on a terminal: decode-1's bar is yellow (75 % full)
        coloured = top.tmux("capture-pane", "-p", "-e", "-t", "top")
        assert re.search(r"decode-1 +\x1b\[33m" + FULL, coloured)

        # It follows the bus: a new decision, its refusal, decode-1 filling up.
        now = time.time()
        await bus.publish(
            "decisions",
            Decision("m-3", "cmpl-c", "decode-0", "decode-1", 9, -9.75, "predicted", now, 3),
        )
        await bus.publish(
            "events",
            Event(EventKind.REFUSED, now, "proxy:p", migration="m-3", detail="not migratable"),
        )
        await bus.publish("reports", report("decode-1", used=10_000, seq=2))
        screen = await top.wait_for(lambda s: "m-3" in s and "(not migratable)" in s)
        (m3,) = [line for line in screen.splitlines() if line.endswith("m-3")]
        assert m3.split()[2:5] == ["refused", "ΔV", "-9.75"]
        await top.wait_for(lambda s: "DRAINING" not in s and "100% 10000/10000" in s)
        assert fill(instance_rows(top.screen())["decode-1"]) == 1.0

        top.tmux("send-keys", "-t", "top", quit_key)
        await until(rc.exists, lambda: f"star top did not exit on {quit_key}")
        assert rc.read_text().strip() == "0"  # a clean exit, not 130 or a traceback
    finally:
        top.close()
