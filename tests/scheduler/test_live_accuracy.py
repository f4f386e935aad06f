"""A real scheduler scores the live predictor from the bus and exports it on /metrics."""

from __future__ import annotations

import asyncio
import time
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from star.bus import Bus, Subscriber
from star.wire import Event, EventKind, RequestLoad
from tests.redis_server import free_port
from tests.reports import report
from tests.scheduler.conftest import Cluster, wait_for

PROMPT = 30
FINAL = 200
MOVED = 100  # tokens generated on "a" before the request continued on "b"


def samples(body: str) -> dict[tuple[str, str], float]:
    """(sample name, bucket label or "") -> value of the predictor's live metrics."""
    out = {}
    for family in text_string_to_metric_families(body):
        for s in family.samples:
            if s.name.startswith("star_predictor_live_"):
                out[(s.name, s.labels.get("bucket", ""))] = s.value
    return out


async def scrape(port: int) -> str:
    def get() -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as r:
            return str(r.read().decode())

    return await asyncio.to_thread(get)


async def consumed(bus: Bus, last_id: str, within_s: float) -> None:
    """Wait until the scheduler's reports group has read and acked up to ``last_id``."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        groups = await bus.redis.xinfo_groups(bus.keys.reports)
        for g in groups:
            last = g["last-delivered-id"]
            last = last.decode() if isinstance(last, bytes) else last
            if last == last_id and g["pending"] == 0:
                return
        await asyncio.sleep(0.05)
    raise AssertionError(f"reports up to {last_id} not consumed: {groups!r}")


async def test_finished_requests_are_scored_by_progress_on_metrics(
    cluster: Cluster, bus: Bus
) -> None:
    port = free_port()
    events = Subscriber(bus, "events", Event, start="0")
    cluster.start("solo", STAR_SCHEDULER_METRICS_PORT=str(port))
    await wait_for(
        events, lambda m: isinstance(m, Event) and m.event is EventKind.LEADER, within_s=60
    )
    # "q" runs 100 tokens on "a" with R-hat 10 too high, then continues on "b"
    # (prompt + those 100 tokens; b counts generated from 0) 4 too low.
    # "x" is aborted by its client: never scored, however wrong.
    last = ""
    for g in range(0, FINAL, 20):
        if g < MOVED:
            q = RequestLoad("q", PROMPT + g, g, FINAL - g + 10.0)
            where = "a"
        else:
            q = RequestLoad("q", PROMPT + g, g - MOVED, FINAL - g - 4.0)
            where = "b"
        x = RequestLoad("x", PROMPT + g, g, 1000.0)
        last = await bus.publish("reports", report(where, requests=[q, x], seq=g + 1))
    await consumed(bus, last, within_s=30)
    for rid, reason in (("q", "stop"), ("x", "abort")):
        await bus.publish(
            "events",
            Event(
                EventKind.FINISHED,
                time.time(),
                "proxy:test",
                request=rid,
                instance="b",
                detail=reason,
                data={"generated": FINAL, "prompt_tokens": PROMPT, "migrations": 1},
            ),
        )

    deadline = time.monotonic() + 30
    got = samples(await scrape(port))
    # The counter is exported at 0 from the start: wait for the scoring itself.
    while (
        got.get(("star_predictor_live_requests_total", "")) != 1.0 and time.monotonic() < deadline
    ):
        await asyncio.sleep(0.1)
        got = samples(await scrape(port))
    assert got[("star_predictor_live_requests_total", "")] == 1.0
    mae = {b: v for (name, b), v in got.items() if name == "star_predictor_live_mae_tokens"}
    points = {b: v for (name, b), v in got.items() if name == "star_predictor_live_points_total"}
    # Progress from the original start: b's points (generated 100..180 in all)
    # land in 100-199 with their own error, a's in the buckets below.
    assert mae == {
        "0": 10.0,
        "1-49": 10.0,
        "50-99": 10.0,
        "100-199": 4.0,
        "all": 7.0,
    }
    assert points == {"0": 1.0, "1-49": 2.0, "50-99": 2.0, "100-199": 5.0}
    abs_error = got[("star_predictor_live_abs_error_tokens_total", "100-199")]
    assert abs_error == 20.0
