"""A SIGTERM to a process holding a ``LocalCluster`` stops the cluster's children.

Benchmarks and tests hold a cluster with ``with LocalCluster(...)``; when
``timeout``, systemd or a CI runner sends SIGTERM, the engines must not outlive
their parent (they did: ``star bench migration`` left ``VLLM::Worker`` behind).
The children here are plain ``sleep`` processes in their own sessions, started
through the cluster's real launcher.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

from star.cli.up import group_members
from tests.procs import sigkill, wait_gone

HOLDER = textwrap.dedent(
    """
    import sys, time
    from star.cli.up import LocalCluster

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
