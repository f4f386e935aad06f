"""A SIGTERM to a process holding a ``LocalCluster`` stops the cluster's children.

Benchmarks and tests hold a cluster with ``with LocalCluster(...)``; when
``timeout``, systemd or a CI runner sends SIGTERM, the engines must not outlive
their parent (they did: ``star bench migration`` left ``VLLM::Worker`` behind).
The children here are plain ``sleep`` processes in their own sessions, started
through the cluster's real launcher; a SIGKILL, which no handler sees, is
tried on a real ``star up``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import psutil
import pytest

from star.fleet import group_members
from tests.procs import cluster_env, reaper, sigkill, wait_gone

HOLDER = textwrap.dedent(
    """
    import sys, time
    from star.fleet import LocalCluster

    class Sleepers(LocalCluster):
        def start(self):
            for name in ("decode-0", "decode-1"):
                self.launcher.start(name, ["sleep", "600"])

    with Sleepers(None, port=0, prefill=1, decode=2, run_dir=sys.argv[1]) as cluster:
        print(" ".join(str(p) for p in cluster.pids().values()), flush=True)
        while True:
            time.sleep(0.1)
    """
)


def test_sigterm_unwinds_the_cluster_and_kills_its_process_groups(tmp_path: Path) -> None:
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(tmp_path)],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": os.getcwd()},
    )
    pids: set[int] = set()
    try:
        assert holder.stdout is not None
        pids = {int(p) for p in holder.stdout.readline().split()}
        assert len(pids) == 2 and group_members(pids), "the children did not start"
        holder.send_signal(signal.SIGTERM)
        holder.wait(timeout=60)
        left = wait_gone(lambda: group_members(pids))
        assert not left, f"left behind: {left}"
        assert holder.returncode != 0  # Terminated ended it, not a clean exit
    finally:
        holder.kill()
        sigkill(pids, group=True)


@pytest.mark.engine
def test_sigkill_of_star_up_leaves_no_process_behind(tmp_path: Path) -> None:
    """No handler sees a SIGKILL: the kernel ends the children (``PR_SET_PDEATHSIG``).

    A real ``star up`` (private redis-server, a prefill and a decode worker,
    scheduler, proxy) is killed once its workers' vLLM engine cores run;
    each child is in a session of its own, so a signal to ``star up``'s
    group reaches none of them.
    """
    with reaper(str(tmp_path)) as mark:
        env = {
            **cluster_env(**mark),
            "STAR_REDIS_URL": "redis://127.0.0.1:1/0",  # none there: a private one
            "STAR_BUS_PREFIX": f"t{uuid.uuid4().hex[:8]}",
        }
        up = subprocess.Popen(
            ["star", "up", "--decode", "1", "--port", "0", "--run-dir", str(tmp_path / "run")],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            env=env,
            cwd=tmp_path,
        )
        groups: set[int] = set()
        try:
            deadline = time.monotonic() + 240
            while time.monotonic() < deadline:
                groups = {c.pid for c in psutil.Process(up.pid).children()}
                members = group_members(groups)
                engines = [m for m in members if "EngineCor" in m[2]]
                # redis-server, prefill-0, decode-0, scheduler, proxy; an engine core per worker
                if len(groups) == 5 and len(engines) >= 2:
                    break
                assert up.poll() is None, "star up exited before its engines ran"
                time.sleep(0.5)
            else:
                raise AssertionError(f"no engine cores within 240 s: {group_members(groups)}")
            up.kill()
            up.wait(10)
            left = wait_gone(lambda: group_members(groups), within_s=60)
            assert not left, f"left behind by a SIGKILLed star up: {left}"
        finally:
            up.kill()
            sigkill(groups, group=True)
