"""A real ``star proxy`` process for a test: started in its own session, waited on, stopped.

The process runs in its own process group, so stopping it (SIGTERM, then
SIGKILL after a bound) cannot leave a child behind; its output goes to a log
file that a failed wait quotes.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import httpx

from star.fleet import LocalCluster, group_members
from star.ports import listen

T = TypeVar("T")


@dataclass
class ProxyProcess:
    proc: subprocess.Popen[bytes]
    port: int
    log: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def health(self, api_key: str = "") -> dict[str, Any] | None:
        """Its ``/health`` document, or None while it does not answer (with
        ``proxy.api_key`` set, the instance lists need ``api_key``)."""
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        try:
            return dict(httpx.get(f"{self.url}/health", headers=headers, timeout=5).json())
        except (httpx.HTTPError, ValueError):
            return None

    def lists(self, role: str) -> list[str]:
        """The ``role`` instances its ``/health`` lists (none while it does not answer)."""
        return list((self.health() or {}).get(role, []))

    def wait(self, pred: Callable[[], bool], what: str, within_s: float) -> None:
        """Poll ``pred`` until it holds; fail if the proxy exits or ``within_s`` passes."""
        deadline = time.monotonic() + within_s
        while not pred():
            assert self.proc.poll() is None, f"proxy exited ({what}):\n{self.tail()}"
            assert time.monotonic() < deadline, f"proxy not {what} within {within_s} s"
            time.sleep(0.3)

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-3000:]


@contextlib.contextmanager
def proxy_process(env: dict[str, str], log: Path, *args: str) -> Iterator[ProxyProcess]:
    """``star proxy`` on a socket bound here (``--fd``, as ``star up`` does) with ``env``.

    Listening when the block starts.
    """
    with listen("127.0.0.1") as sock, log.open("wb") as out:
        port = int(sock.getsockname()[1])
        proc = subprocess.Popen(
            [sys.executable, "-m", "star.cli.main", "proxy", "--fd", str(sock.fileno()), *args],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            pass_fds=(sock.fileno(),),
        )
    try:
        p = ProxyProcess(proc, port, log)
        p.wait(lambda: p.health() is not None, "listening", 300)  # a cold start under load
        yield p
    finally:
        stop_group(proc)


def stop_group(proc: subprocess.Popen[bytes], timeout_s: float = 30.0) -> None:
    """SIGTERM ``proc``'s process group; SIGKILL what is left of it after ``timeout_s``."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout_s)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def wait_gone(alive: Callable[[], Sequence[T]], within_s: float = 30.0) -> Sequence[T]:
    """Poll ``alive`` (what is still running) until it is empty or ``within_s`` pass.

    Returns its last answer: empty when everything went in time.
    """
    deadline = time.monotonic() + within_s
    left = alive()
    while left and time.monotonic() < deadline:
        time.sleep(0.1)
        left = alive()
    return left


def sigkill(pids: Iterable[int], group: bool = False) -> None:
    """SIGKILL each of ``pids`` (each one's process group with ``group``), if still there."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            if group:
                os.killpg(pid, signal.SIGKILL)
            else:
                os.kill(pid, signal.SIGKILL)


def cluster_env(**extra: str) -> dict[str, str]:
    """The environment of a test's ``LocalCluster``: this one's, made fit for a loaded host.

    No config file or API key of the caller's leaks in.
    """
    env = {
        **os.environ,
        # A small KV pool: registering 1 GiB with NIXL took ~60 s per engine on a loaded host.
        "STAR_WORKER_KV_CACHE_SPACE_GIB": "0.125",
        # Several engines, clients and pytest share two cores here: a starved
        # worker's report can come late, which is no reason to stop serving.
        "STAR_SCHEDULER_STALENESS_S": "15",
        "STAR_LOG_LEVEL": "info",
        **extra,
    }
    env.pop("STAR_CONFIG", None)
    env.pop("STAR_PROXY_API_KEY", None)
    return env


# Set in the environment of every process a test run starts (inherited by
# their children); what the reaper kills once the test process is gone.
RUN_MARK = "STAR_TEST_RUN"

_REAPER = """
import os, signal, sys, time
sys.stdin.buffer.read()  # EOF: the test process is gone, however it ended
mark, run = sys.argv[1].encode(), sys.argv[2]
for _ in range(3):  # a process being forked as we look is found on the next pass
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                marked = mark in f.read().split(b"\\0")
            marked = marked or os.readlink(f"/proc/{pid}/cwd") == run
            if marked and int(pid) != os.getpid():
                os.kill(int(pid), signal.SIGKILL)
        except OSError:
            pass
    time.sleep(0.5)
"""


@contextlib.contextmanager
def reaper(run: str) -> Iterator[dict[str, str]]:
    """SIGKILL every process started with ``STAR_TEST_RUN=run`` once this process is gone.

    ``run`` is the run's own directory: a process working in it is the run's
    too (redis-server writes its process title over its environment).

    Yields the environment entry to give those processes. A watcher in its
    own session holds the read end of a pipe whose write end only this
    process has: when it dies -- SIGKILL, ``os._exit``, or a teardown cut
    short -- the watcher reads EOF and kills what carries the mark (Linux
    ``/proc``). On a normal exit it finds nothing left and ends.
    """
    mark = {RUN_MARK: run}
    env = {k: v for k, v in os.environ.items() if k != RUN_MARK}
    watcher = subprocess.Popen(
        [sys.executable, "-c", _REAPER, f"{RUN_MARK}={run}", os.path.realpath(run)],
        stdin=subprocess.PIPE,
        env=env,
        start_new_session=True,  # a signal to this process's group does not reach it
    )
    try:
        yield mark
    finally:
        assert watcher.stdin is not None
        watcher.stdin.close()
        with contextlib.suppress(subprocess.TimeoutExpired):
            watcher.wait(30)


class Interrupted(KeyboardInterrupt):
    """SIGTERM arrived: pytest stops the session and tears its fixtures down."""


@contextlib.contextmanager
def sigterm_interrupts() -> Iterator[None]:
    """Make SIGTERM (``timeout``, a CI runner) stop pytest the way Ctrl-C does.

    pytest unwinds only ``KeyboardInterrupt`` and its own ``Exit``: any other
    exception raised by a signal handler (``star.fleet.Terminated``) fails
    the running test and the session goes on, and by default SIGTERM kills
    the process with no teardown at all. Fixtures' teardown runs in either
    case here; a second SIGTERM is ignored so that it cannot cut the
    teardown short (the :func:`reaper` covers a SIGKILL).
    """

    def interrupt(signum: int, frame: object) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        raise Interrupted("SIGTERM")

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@contextlib.contextmanager
def running(cluster: LocalCluster, ready_s: float = 600.0) -> Iterator[LocalCluster]:
    """Start ``cluster``, wait until it is ready, stop it after; no process may be left.

    The leftover check covers the processes it started and any restarted since.
    """
    pids: dict[str, int] = {}
    try:
        cluster.start()
        pids = cluster.pids()
        cluster.wait_ready(ready_s)
        yield cluster
    finally:
        groups = set(pids.values()) | set(cluster.pids().values())  # restarted ones too
        cluster.stop(timeout_s=10)
        leftovers = group_members(groups)
        assert not leftovers, f"processes left behind (pid, pgid, name): {leftovers}"


def start_star_up(run: Path, env: dict[str, str], *args: str) -> subprocess.Popen[str]:
    """``star up --port 0 ARGS`` run as a user would, its logs in ``run/run`` and its
    stderr in ``run/up.stderr``; read its stdout with :func:`star_up_ready`."""
    with (run / "up.stderr").open("w") as err:
        return subprocess.Popen(
            ["star", "up", "--port", "0", "--run-dir", str(run / "run"), *args],
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
            env=env,
            cwd=run,
        )


def star_up_ready(up: subprocess.Popen[str], run: Path) -> tuple[str, list[str]]:
    """The proxy URL of ``star up: ready in ... proxy on URL`` and the lines before it."""
    assert up.stdout is not None
    said: list[str] = []
    for line in up.stdout:
        said.append(line)
        found = re.search(r"ready in .* proxy on (http://127\.0\.0\.1:\d+)", line)
        if found:
            return found.group(1), said
    raise AssertionError(f"star up never got ready:\n{(run / 'up.stderr').read_text()[-3000:]}")


def kill_star_up(up: subprocess.Popen[str], groups: set[int]) -> None:
    """A test's cleanup of :func:`start_star_up`: SIGKILL it and every process group
    it started (``groups``: its children's, collected while it ran)."""
    up.kill()
    up.wait(30)
    if up.stdout is not None:
        up.stdout.close()
    sigkill(groups, group=True)
