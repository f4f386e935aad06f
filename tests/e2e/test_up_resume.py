"""The README's quick start: a stream resumed after ``star up``'s proxy was killed.

A real ``star up`` (a private redis-server, a prefill and a decode worker on
the tiny model, the scheduler, one proxy). A client's stream is cut by a
SIGKILL of the proxy mid-body; ``star up`` starts the proxy again on the same
port, and the client asks that port for the rest with the last id it got:
the text and the token count equal an unbroken greedy run's. A deliberate
stop (SIGTERM of ``star up``) restarts nothing and leaves no process behind.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest

from proxy import sse
from star.fleet import group_members
from star.model.task import Prompt
from tests.e2e.streams import SSE, events, text, usage
from tests.procs import (
    cluster_env,
    kill_star_up,
    reaper,
    star_up_ready,
    start_star_up,
    wait_gone,
)

pytestmark = [pytest.mark.engine, pytest.mark.timeout(900)]


def _proxy_pid(up: subprocess.Popen[str]) -> int | None:
    for child in psutil.Process(up.pid).children():
        with contextlib.suppress(psutil.Error):
            if "proxy" in child.cmdline():
                return int(child.pid)
    return None


def _health(url: str) -> dict[str, Any]:
    try:
        return dict(httpx.get(f"{url}/health", timeout=5).json())
    except (httpx.HTTPError, ValueError):
        return {}


def test_a_stream_resumes_on_star_ups_proxy_after_it_was_killed(tmp_path: Path) -> None:
    with reaper(str(tmp_path)) as mark:
        env = {
            **cluster_env(**mark),
            "STAR_REDIS_URL": "redis://127.0.0.1:1/0",  # none there: a private one
            "STAR_BUS_PREFIX": f"t{uuid.uuid4().hex[:8]}",
        }
        stderr = tmp_path / "up.stderr"
        up = start_star_up(tmp_path, env, "--decode", "1")
        groups: set[int] = set()
        try:
            url, _ = star_up_ready(up, tmp_path)
            groups = {c.pid for c in psutil.Process(up.pid).children()}
            body = {
                "model": "star-tiny",
                "messages": Prompt(topic="animals", size="medium", start="owl").messages(),
                "max_tokens": 160,  # still decoding when its proxy is killed
                "temperature": 0,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            path = "/v1/chat/completions"
            with httpx.Client(base_url=url, timeout=300, headers=SSE) as c:
                with c.stream("POST", path, json=body) as resp:
                    whole = events(resp)
                killed = _proxy_pid(up)
                assert killed is not None
                with contextlib.suppress(httpx.HTTPError):
                    with c.stream("POST", path, json=body) as resp:
                        first = events(resp, 5)
                        os.killpg(killed, signal.SIGKILL)  # mid-stream: no cleanup runs
                assert first[-1].data != sse.DONE_DATA
                # star up starts the proxy again on the same port.
                deadline = time.monotonic() + 120
                while _proxy_pid(up) in (None, killed) or not _health(url).get("decode"):
                    assert up.poll() is None, f"star up exited:\n{stderr.read_text()[-3000:]}"
                    assert time.monotonic() < deadline, "the proxy did not come back"
                    time.sleep(0.25)
                with c.stream("GET", f"/v1/streams/{first[-1].id}") as resp:
                    assert resp.status_code == 200, resp.read()
                    rest = events(resp)
            assert text(first + rest) == text(whole) != ""
            assert usage(rest) == usage(whole)
            assert rest[-1].data == sse.DONE_DATA
            logs = (tmp_path / "run" / "proxy.log").read_text()
            assert '"stream_adopted"' in logs  # the new proxy took the request over
            assert (tmp_path / "run" / "proxy.1.log").exists()  # the killed one's log, kept
            groups |= {c.pid for c in psutil.Process(up.pid).children()}

            up.send_signal(signal.SIGTERM)  # a deliberate stop: nothing is started again
            assert up.wait(120) == 0
            noted = stderr.read_text()
            assert noted.count("starting it again") == noted.count("started again (pid") == 1
            left = wait_gone(lambda: group_members(groups), within_s=60)
            assert not left, f"left behind: {left}"
        finally:
            kill_star_up(up, groups)
