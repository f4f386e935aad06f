"""``star up`` starts a proxy that died again (``LocalCluster(restart_proxy=True)``).

The cluster's real launcher and supervision; the "proxy" is a plain ``sleep``
started on the cluster's listening socket (the real one is in
``tests/e2e/test_up_resume.py``). Bounded, with pauses; a proxy that could
not start is not retried; a deliberate stop restarts nothing; without the
flag a dead proxy stops the cluster as before.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

import star.fleet.cluster as cluster_module
from star.fleet import ClusterError, LocalCluster


class SleepingProxy(LocalCluster):
    def start(self) -> None:
        assert self._proxy_sock is not None
        fd = self._proxy_sock.fileno()
        self._proxy_started_at = time.monotonic()
        self.launcher.start("proxy", ["sleep", "600"], pass_fds=(fd,))


def _kill_proxy(cluster: LocalCluster) -> int:
    pid = cluster.pids()["proxy"]
    os.killpg(pid, signal.SIGKILL)
    proc = cluster.launcher.children[0].proc
    assert proc is not None
    proc.wait(10)
    return pid


def _until_restarted(cluster: LocalCluster, old: int, within_s: float = 10.0) -> int:
    deadline = time.monotonic() + within_s
    while cluster.pids()["proxy"] == old:
        cluster.check()  # what star up's loop calls every 0.5 s
        assert time.monotonic() < deadline, "the proxy was not started again"
        time.sleep(0.02)
    return cluster.pids()["proxy"]


@pytest.fixture(autouse=True)
def short_pauses(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cluster_module, "PROXY_RESTART_DELAYS_S", (0.2, 0.4))


def test_a_killed_proxy_is_started_again_on_the_same_socket_within_a_bound(
    tmp_path: Path,
) -> None:
    notes: list[str] = []
    with SleepingProxy(
        None, port=0, run_dir=tmp_path, env={}, restart_proxy=True, notify=notes.append
    ) as cluster:
        port = cluster.port
        first = _kill_proxy(cluster)
        killed_at = time.monotonic()
        second = _until_restarted(cluster, first)
        assert time.monotonic() - killed_at >= 0.2  # after its pause, not at once
        assert second != first and cluster.port == port
        assert (tmp_path / "proxy.1.log").exists()  # the dead one's log kept
        assert "status -9" in notes[0] and "started again" in notes[1]
        assert os.readlink(f"/proc/{second}/fd/{cluster._proxy_sock.fileno()}").startswith(
            "socket:"
        )  # the same listening socket handed over again
        third = _until_restarted(cluster, _kill_proxy(cluster))
        assert third != second
        _kill_proxy(cluster)  # a third death in a row: the bound is 2 restarts
        with pytest.raises(ClusterError, match="proxy exited with status -9"):
            for _ in range(100):
                cluster.check()
                time.sleep(0.02)
        assert "not starting it again" in notes[-1]


def test_a_proxy_that_could_not_start_and_a_stopped_cluster_are_not_restarted(
    tmp_path: Path,
) -> None:
    with SleepingProxy(None, port=0, run_dir=tmp_path, env={}, restart_proxy=True) as cluster:
        (tmp_path / "proxy.log").write_text('{"event": "startup_failed", "level": "error"}\n')
        _kill_proxy(cluster)
        with pytest.raises(ClusterError, match="proxy exited"):
            cluster.check()
    with SleepingProxy(None, port=0, run_dir=tmp_path, env={}, restart_proxy=True) as cluster:
        pid = cluster.pids()["proxy"]
    with pytest.raises(ClusterError, match="proxy exited"):  # stopped: reported, not restarted
        cluster.check()
    assert cluster.pids()["proxy"] == pid


def test_without_the_flag_a_dead_proxy_stops_the_cluster(tmp_path: Path) -> None:
    with SleepingProxy(None, port=0, run_dir=tmp_path, env={}) as cluster:
        _kill_proxy(cluster)
        with pytest.raises(ClusterError, match="proxy exited with status -9"):
            cluster.check()
