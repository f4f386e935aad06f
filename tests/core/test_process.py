"""The process base: signals set flags, drain with timeout, sd_notify."""

from __future__ import annotations

import asyncio
import gc
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from star.process import (
    SafePointCollector,
    Service,
    sd_notify,
    set_gc_gen0_threshold,
    watchdog_interval,
)


def start(args: list[str], env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.core.svc_main", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, **(env or {})},
        cwd=Path(__file__).parents[2],
    )
    assert proc.stdout is not None
    deadline = time.monotonic() + 120  # a cold interpreter start takes seconds under load
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if '"started"' in line:
            return proc
        if not line and proc.poll() is not None:
            break
    proc.kill()
    raise AssertionError("service did not start")


def read_until(proc: subprocess.Popen[str], marker: str) -> str:
    """Lines of the service's output up to and including the one with ``marker``."""
    assert proc.stdout is not None
    seen = ""
    while marker not in seen:
        line = proc.stdout.readline()
        if not line:
            raise AssertionError(f"no {marker!r} before EOF; got {seen!r}")
        seen += line
    return seen


def test_sigterm_drains_then_cleans_up_and_exits_zero() -> None:
    proc = start(["0.2", "5"])
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0
    assert out.index("drain-begin") < out.index("drain-end") < out.index("cleanup")


def test_drain_timeout_bounds_the_stop() -> None:
    proc = start(["30", "0.3"])
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)
    assert time.monotonic() - t0 < 20  # the drain alone would take 30 s
    assert "drain_timed_out" in out and "drain-end" not in out and "cleanup" in out


def test_second_signal_forces_exit() -> None:
    proc = start(["30", "60"])
    proc.send_signal(signal.SIGINT)
    first = read_until(proc, "drain-begin")  # the first signal was handled
    t0 = time.monotonic()
    proc.send_signal(signal.SIGINT)
    rest, _ = proc.communicate(timeout=120)
    assert time.monotonic() - t0 < 20  # the drain alone would take 30 s
    out = first + rest
    assert "second_signal_forcing_exit" in out and "cleanup" in out


def test_sd_notify_ready_watchdog_stopping(tmp_path: Path) -> None:
    path = str(tmp_path / "notify.sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind(path)
        sock.settimeout(60)
        proc = start(["0", "5"], env={"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "100000"})
        got = [sock.recv(64).decode() for _ in range(3)]
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=120)
        rest = []
        sock.settimeout(0.5)
        try:
            while True:
                rest.append(sock.recv(64).decode())
        except TimeoutError:
            pass
    assert got[0] == "READY=1"
    assert "WATCHDOG=1" in got[1:]
    assert "STOPPING=1" in rest


def test_sd_notify_without_socket_is_a_no_op() -> None:
    assert sd_notify("READY=1", env={}) is False


def test_watchdog_interval() -> None:
    assert watchdog_interval({"WATCHDOG_USEC": "2000000"}) == 1.0
    assert watchdog_interval({"WATCHDOG_USEC": "2000000", "WATCHDOG_PID": "1"}) is None
    assert watchdog_interval({}) is None


class Failing(Service):
    async def startup(self) -> None:
        raise RuntimeError("port in use")


class Crashing(Service):
    async def main(self) -> None:
        async def boom() -> None:
            raise ValueError("background failure")

        self.spawn(boom(), "boom")
        await self.wait_exit()


async def test_failed_startup_returns_nonzero() -> None:
    assert await Failing().serve(install_signals=False) == 1


async def test_failing_owned_task_stops_the_service() -> None:
    svc = Crashing(drain_timeout_s=1)
    assert await asyncio.wait_for(svc.serve(install_signals=False), 60) == 1
    assert isinstance(svc.failed, ValueError)


async def test_request_exit_stops_main() -> None:
    svc = Service(drain_timeout_s=1)
    task = asyncio.create_task(svc.serve(install_signals=False))
    await asyncio.sleep(0.05)
    svc.request_exit()
    assert await asyncio.wait_for(task, 60) == 0


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_both_signals_are_graceful(sig: signal.Signals) -> None:
    proc = start(["0", "5"])
    proc.send_signal(sig)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0 and "drain-end" in out


class StartedHeap(Service):
    """Records what start-up allocated and whether it was frozen by the time main runs."""

    async def startup(self) -> None:
        self.loaded = [object() for _ in range(1000)]  # stands in for imported libraries

    async def main(self) -> None:
        self.frozen_at_main = gc.get_freeze_count()
        self.request_exit()


async def test_start_up_heap_is_frozen_before_main() -> None:
    gc.unfreeze()
    svc = StartedHeap(drain_timeout_s=1)
    try:
        assert gc.get_freeze_count() == 0
        assert await asyncio.wait_for(svc.serve(install_signals=False), 60) == 0
        # Start-up's objects sit in the permanent generation: a full collection
        # no longer walks them while the service relays tokens.
        assert svc.frozen_at_main >= len(svc.loaded)
    finally:
        gc.unfreeze()


def test_gc_gen0_threshold_raises_young_collections_only() -> None:
    before = gc.get_threshold()
    try:
        gc.set_threshold(700, 10, 10)
        assert set_gc_gen0_threshold(50_000) == (50_000, 10, 10)  # older generations kept
        assert gc.get_threshold() == (50_000, 10, 10)
        assert set_gc_gen0_threshold(0) == (50_000, 10, 10)  # 0 leaves it as it is
    finally:
        gc.set_threshold(*before)


def test_safe_point_collector_runs_only_when_asked_what_is_due() -> None:
    before = gc.get_threshold()
    collections: list[int] = []

    def seen(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            collections.append(info["generation"])

    gc.set_threshold(1_000, 10, 10)
    gc.collect()
    collector = SafePointCollector()
    gc.callbacks.append(seen)
    try:
        assert not gc.isenabled()
        assert collector.collect_due() is None  # nothing allocated yet
        kept = [[] for _ in range(5_000)]  # far past the young threshold
        assert collections == []  # the interpreter did not collect by itself
        assert collector.collect_due() == 0 and collections == [0]
        assert collector.collect_due() is None  # the count starts again
        for _ in range(11):  # ten young collections make the middle one due
            kept += [[] for _ in range(1_100)]
            gc.collect(0)
        collections.clear()
        assert collector.collect_due() == 1 and collections == [1]
    finally:
        gc.callbacks.remove(seen)
        collector.close()
        gc.set_threshold(*before)
    assert gc.isenabled()
