"""``star up`` on a Redis that Sentinel watches, served through a failover.

A real ``star up`` (a prefill and a decode worker on the tiny model, the
scheduler, one proxy) given ``redis.sentinels``: real ``redis-server``
processes, a master, its replica and a Sentinel. A greedy stream before
``SENTINEL FAILOVER`` and the same request after it get the same text and
usage, the workers' reports land on the promoted master, and another
terminal's ``star status`` finds the cluster with the hint ``star up``
printed. (With no Sentinel answering it refuses to start:
``tests/cli/test_up_checks.py``.)
"""

from __future__ import annotations

import shlex
import signal
import subprocess
import time
import uuid
from pathlib import Path

import httpx
import psutil
import pytest

from proxy import sse
from star.fleet import group_members
from star.model.task import Prompt
from tests.bus.sentinel_set import SERVICE, SentinelSet
from tests.e2e.streams import SSE, events, text, usage
from tests.procs import (
    cluster_env,
    kill_star_up,
    reaper,
    star_up_ready,
    start_star_up,
    wait_gone,
)


def _stream(url: str, body: dict[str, object]) -> list[sse.Event]:
    with httpx.Client(base_url=url, timeout=300, headers=SSE) as c:
        with c.stream("POST", "/v1/chat/completions", json=body) as resp:
            assert resp.status_code == 200, resp.read()
            return list(events(resp))


@pytest.mark.engine
@pytest.mark.timeout(900)
def test_star_up_on_sentinels_serves_across_a_failover(tmp_path: Path) -> None:
    redis = SentinelSet(tmp_path / "redis", replicas=1, sentinels=1)
    with reaper(str(tmp_path)) as mark:
        redis.start()
        prefix = f"t{uuid.uuid4().hex[:8]}"
        env = {
            **cluster_env(**mark),
            "STAR_BUS_PREFIX": prefix,
            "STAR_REDIS_SENTINELS": ",".join(redis.addresses),
            "STAR_REDIS_SERVICE_NAME": SERVICE,
        }
        up = start_star_up(tmp_path, env, "--decode", "1")
        groups: set[int] = set()
        try:
            url, said = star_up_ready(up, tmp_path)
            assert f"star up: on the master '{SERVICE}' of Sentinels 127.0.0.1:" in "".join(said)
            assert up.stdout is not None
            # "  STAR_REDIS_SENTINELS=... STAR_...=... star status   # instances, ..."
            hint = next((line for line in up.stdout if " status " in line), "")
            groups = {c.pid for c in psutil.Process(up.pid).children()}
            body = {
                "model": "star-tiny",
                "messages": Prompt(topic="animals", size="medium", start="owl").messages(),
                "max_tokens": 48,
                "temperature": 0,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            before = _stream(url, body)
            old = redis.master()
            with redis.sentinels[0].client() as sentinel:
                sentinel.execute_command("SENTINEL", "FAILOVER", SERVICE)
            deadline = time.monotonic() + 60
            while redis.master() is old:
                assert time.monotonic() < deadline, "Sentinel did not fail over"
                time.sleep(0.1)
            switched_ms = int(time.time() * 1000)
            after = _stream(url, body)
            assert text(after) == text(before) != ""
            assert usage(after) == usage(before)
            # The workers report to the promoted master now, not to the old one.
            new = redis.master()
            deadline = time.monotonic() + 60
            while True:
                with new.client() as client:
                    last = client.xrevrange(f"{prefix}:reports", count=1)
                if last and int(last[0][0].split(b"-")[0]) > switched_ms:
                    break
                assert time.monotonic() < deadline, "no report reached the promoted master"
                time.sleep(0.25)
            # Another terminal finds the cluster with what star up printed.
            assignments = [w for w in shlex.split(hint) if "=" in w and w.startswith("STAR_")]
            assert any(w.startswith("STAR_REDIS_SENTINELS=") for w in assignments), hint
            status_env = {k: v for k, v in cluster_env().items() if not k.startswith("STAR_REDIS")}
            status_env.update(dict(w.split("=", 1) for w in assignments if "$(" not in w))
            secret = (tmp_path / "run" / "cluster.secret").read_text().strip()
            status_env["STAR_CLUSTER_SECRET"] = secret
            shown = subprocess.run(
                ["star", "status"], capture_output=True, text=True, timeout=60, env=status_env
            )
            assert shown.returncode == 0, shown.stderr
            assert "decode-0" in shown.stdout
            groups |= {c.pid for c in psutil.Process(up.pid).children()}
            up.send_signal(signal.SIGTERM)
            assert up.wait(120) == 0
            left = wait_gone(lambda: group_members(groups), within_s=60)
            assert not left, f"left behind: {left}"
        finally:
            kill_star_up(up, groups)
            redis.stop()
