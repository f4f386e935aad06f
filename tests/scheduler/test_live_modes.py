"""Oracle and predicted modes on a live scheduler process: what it cannot know is said, not fatal.

A real ``star scheduler`` against a real redis-server, fed reports as workers
publish them: in ``oracle`` mode only some requests carry ``true_remaining``
(a worker knows it only for ``ignore_eos`` + ``max_tokens`` requests); in
``predicted`` mode some instances report no length predictor.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import Any

import msgspec
import pytest

from star.bus import Bus, Subscriber
from star.planner.trace import bin_edges
from star.planner.types import PlannerParams
from star.settings import SchedulerSettings, Settings, WorkerSettings
from star.wire import Decision, Report, RequestLoad
from tests.redis_server import free_port
from tests.reports import report
from tests.scheduler.conftest import Cluster, wait_for
from tests.scheduler.test_service import star_status


def start(cluster: Cluster, node: str, log: Path, **env: str) -> subprocess.Popen[bytes]:
    """A scheduler process whose log lines (JSON) go to ``log``."""
    with log.open("wb") as out:
        proc = subprocess.Popen(
            ["star", "scheduler", "--node", node],
            env=cluster.env(**env),
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    cluster.procs.append(proc)
    return proc


def lines(log: Path, event_start: str) -> list[dict[str, Any]]:
    out = []
    for line in log.read_text().splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if str(rec.get("event", "")).startswith(event_start):
            out.append(rec)
    return out


async def publish_forever(bus: Bus, reports: list[Report]) -> None:
    seq = 0
    while True:
        seq += 1
        for r in reports:
            await bus.publish("reports", msgspec.structs.replace(r, seq=seq, ts=time.time()))
        await asyncio.sleep(0.2)


def oracle_reports() -> list[Report]:
    # "a-short" holds the most tokens but ends at once: by current load it is
    # the best move, by its true length too short to move. "a-open" was sent
    # without ignore_eos: its length is not known.
    a = [
        RequestLoad("a-short", 1800, 1, true_remaining=1),
        RequestLoad("a-long", 1000, 1, true_remaining=4000),
        RequestLoad("a-open", 600, 1),
    ]
    return [
        report("a", used=3400, requests=a, capacity=100_000, trace=[]),
        report("b", used=0, capacity=100_000, trace=[]),
    ]


async def test_oracle_mode_keeps_ticking_and_moves_by_true_lengths(
    cluster: Cluster, bus: Bus, tmp_path: Path
) -> None:
    log = tmp_path / "scheduler.log"
    decisions = Subscriber(bus, "decisions", Decision, start="0")
    reporter = asyncio.create_task(publish_forever(bus, oracle_reports()))
    proc = start(
        cluster, "solo", log, STAR_SCHEDULER_MODE="oracle", STAR_SCHEDULER_DISPATCH="round-robin"
    )
    try:
        got = await wait_for(decisions, lambda m: isinstance(m, Decision), within_s=60)
        d = got[-1]
        assert isinstance(d, Decision)
        assert (d.request, d.source, d.target, d.mode) == ("a-long", "a", "b", "oracle")
        # Published beside the load view for the proxies (proxy.cluster follows it).
        async with asyncio.timeout(30):  # written right after the decision
            while (await bus.read_dispatch())[1] != "round-robin":  # noqa: ASYNC110 (state in Redis)
                await asyncio.sleep(0.05)
        await asyncio.sleep(1.0)  # ten more ticks with the unknown request in view
        assert proc.poll() is None, log.read_text()[-2000:]
        warned = lines(log, "oracle_lengths_unknown")
        assert [w["requests"] for w in warned] == [["a-open"]], warned  # once, not per tick
        assert warned[0]["count"] == 1 and warned[0]["level"] == "warning"
    finally:
        reporter.cancel()


async def test_predicted_mode_names_instances_without_a_predictor(
    cluster: Cluster, bus: Bus, tmp_path: Path
) -> None:
    log = tmp_path / "scheduler.log"
    port = free_port()
    fleet = [
        msgspec.structs.replace(report("a"), predictor=False),
        msgspec.structs.replace(report("b"), predictor=True),
        report("c"),  # an older worker: does not say
        msgspec.structs.replace(report("p", role="prefill"), predictor=None),
    ]
    reporter = asyncio.create_task(publish_forever(bus, fleet))
    proc = start(
        cluster, "solo", log, STAR_SCHEDULER_MODE="predicted", STAR_SCHEDULER_METRICS_PORT=str(port)
    )
    try:
        async with asyncio.timeout(60):
            while not lines(log, "instance_without_predictor"):  # noqa: ASYNC110 (state in a file)
                await asyncio.sleep(0.1)
        await asyncio.sleep(1.0)  # ten more ticks
        assert proc.poll() is None
        warned = lines(log, "instance_without_predictor")
        assert [(w["instance"], w["mode"]) for w in warned] == [("a", "predicted")], warned
        body = await asyncio.to_thread(
            lambda: (
                urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30)
                .read()
                .decode()
            )
        )
        assert "star_scheduler_instances_without_predictor 1.0" in body

        status = await star_status(cluster)
        said = {i["instance"]: i["predictor"] for i in status["instances"]}
        assert said == {"a": False, "b": True, "c": None, "p": None}
        text = await asyncio.to_thread(
            subprocess.run,
            ["star", "status"],
            capture_output=True,
            text=True,
            env=cluster.env(),
            timeout=60,
        )
        out = text.stdout.splitlines()
        at = next(ln for ln in out if ln.startswith("instance")).index("pred")
        column = {
            ln.split()[0]: ln[at : at + 4].strip()
            for ln in out
            if ln[:2] in {"a ", "b ", "c ", "p "}
        }
        assert column == {"a": "NO", "b": "yes", "c": "-", "p": "-"}
    finally:
        reporter.cancel()


@pytest.mark.parametrize(
    ("scheduler", "worker", "scale"),
    [
        ({}, {}, 4096),  # the served model's context (worker.max_model_len's default)
        ({}, {"max_model_len": 2048}, 2048),
        ({"bins_scale_tokens": 32768}, {}, 32768),  # the paper's edges, asked for
    ],
)
def test_bins_edges_follow_the_served_model_unless_set(
    scheduler: dict[str, Any], worker: dict[str, Any], scale: int
) -> None:
    settings = Settings(
        scheduler=SchedulerSettings(mode="bins:4", **scheduler), worker=WorkerSettings(**worker)
    )
    params = PlannerParams.from_settings(settings)
    assert params.bins_scale_tokens == scale
    assert bin_edges(4, params.bins_scale_tokens)[-1] == scale
