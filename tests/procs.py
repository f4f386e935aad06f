"""A real ``star proxy`` process for a test: started in its own session, waited on, stopped.

The process runs in its own process group, so stopping it (SIGTERM, then
SIGKILL after a bound) cannot leave a child behind; its output goes to a log
file that a failed wait quotes.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from tests.redis_server import free_port


@dataclass
class ProxyProcess:
    proc: subprocess.Popen[bytes]
    port: int
    log: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def health(self) -> dict[str, Any] | None:
        """Its ``/health`` document, or None while it does not answer."""
        try:
            return dict(httpx.get(f"{self.url}/health", timeout=5).json())
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
    """``star proxy`` on a free port with ``env``; listening when the block starts."""
    port = free_port()
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "star.cli.main", "proxy", "--port", str(port), *args],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
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
