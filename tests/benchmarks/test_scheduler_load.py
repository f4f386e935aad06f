"""``star bench scheduler``: its report bodies and entries are the real ones, and a small run is sane."""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import time

import numpy as np
import pytest

from benchmarks.emulated_workers import (
    GenStats,
    advance,
    entry_fields,
    follow,
    make_fleet,
    migrate,
    report_body,
)
from benchmarks.scheduler_load import PHASES, configure, quantile, run, summarise
from star.bus import Bus, Subscriber
from star.settings import Settings
from star.wire import Decision, Event, EventKind, Report, decode_as, encode
from workers.state import load_trace


def test_report_body_is_what_wire_encode_writes() -> None:
    settings = Settings()
    fleet = make_fleet(8, 32, 25.0, settings, seed=3)
    for inst in fleet.instances:
        for _ in range(40):  # long enough that finished requests are replaced
            advance(fleet, inst)
        body, used = report_body(fleet, inst, 1234.5)
        report = decode_as(body, Report)  # strict: schema-valid
        assert report.instance == inst.name and report.seq == inst.seq
        assert report.delta == settings.scheduler.delta
        assert len(report.trace) == settings.scheduler.horizon + 1
        assert [r.id for r in report.requests] == inst.ids
        assert used == sum(r.tokens for r in report.requests) == report.used_tokens
        assert all(
            r.generated < o for r, o in zip(report.requests, inst.output.tolist(), strict=True)
        )
        # The worker's own trace of these requests, and byte for byte encode().
        assert report.trace == load_trace(
            ((r.tokens, r.predicted_remaining) for r in report.requests),
            settings.scheduler.delta,
            settings.scheduler.horizon,
        )
        assert encode(report) == body
    assert fleet.instances[0].serial > 32  # requests finished and were replaced


def test_batches_and_rates_differ_between_instances() -> None:
    settings = Settings()
    fleet = make_fleet(64, 64, 25.0, settings, seed=0)
    sizes = [len(i.ids) for i in fleet.instances]
    assert 32 <= min(sizes) < max(sizes) <= 96
    # Every report_every_steps steps, at most every report_interval_s.
    for inst in fleet.instances:
        assert inst.period_s <= settings.worker.report_interval_s
        assert inst.period_s == pytest.approx(
            min(settings.worker.report_every_steps * inst.step_s, settings.worker.report_interval_s)
        )


async def test_entries_are_those_bus_publish_writes(bus: Bus) -> None:
    fleet = make_fleet(1, 4, 25.0, Settings(), seed=1)
    inst = fleet.instances[0]
    body, used = report_body(fleet, inst, time.time())
    await bus.publish("reports", decode_as(body, Report))
    await bus.redis.xadd(bus.keys.reports, entry_fields(inst, body, used))  # type: ignore[arg-type]
    (_, published), (_, ours) = await bus.redis.xrange(bus.keys.reports)
    assert published == ours


def test_quantile_interpolates_within_buckets() -> None:
    buckets = {0.01: 50.0, 0.02: 90.0, 0.1: 100.0, math.inf: 100.0}
    assert quantile(buckets, 0.5) == pytest.approx(0.01)
    assert quantile(buckets, 0.7) == pytest.approx(0.015)
    assert quantile(buckets, 0.99) == pytest.approx(0.02 + 0.08 * 0.9)
    assert math.isinf(quantile({0.1: 0.0, math.inf: 10.0}, 0.5))
    assert math.isnan(quantile({0.1: 0.0, math.inf: 0.0}, 0.5))


def test_migrate_moves_a_request_between_batches() -> None:
    fleet = make_fleet(2, 8, 25.0, Settings(), seed=2)
    a, b = fleet.instances
    rid, j = a.ids[3], 3
    want = (int(a.prompt[j]), int(a.output[j]), int(a.generated[j]))
    sizes = len(a.ids), len(b.ids)
    assert migrate(a, b, rid) == want[0] + want[2]
    assert rid not in a.ids and b.ids[-1] == rid
    assert (int(b.prompt[-1]), int(b.output[-1]), int(b.generated[-1])) == want
    assert (len(a.ids), len(b.ids)) == (sizes[0] - 1, sizes[1] + 1)
    assert a.prompt.size == a.output.size == a.generated.size == len(a.ids)
    assert migrate(a, b, rid) is None  # no longer on a
    # The next reports list it on b only.
    listed = {inst.name: [r.id for r in decode_as(report_body(fleet, inst, 1.0)[0], Report).requests] for inst in (a, b)}  # fmt: skip
    assert rid in listed[b.name] and rid not in listed[a.name]


async def test_follow_carries_decisions_out_and_says_so(bus: Bus) -> None:
    fleet = make_fleet(2, 8, 25.0, Settings(), seed=2)
    a, b = fleet.instances
    stats = GenStats()
    events = Subscriber(bus, "events", Event, start="$")
    follower = asyncio.create_task(follow(bus, fleet, stats))
    try:
        await asyncio.sleep(0.1)  # subscribed
        rid = a.ids[0]
        for mid, request in (("m-1", rid), ("m-2", "gone")):
            await bus.publish("decisions", Decision(mid, request, a.name, b.name, 1, -1.0, "predicted", 0.0))  # fmt: skip
        got = []
        async with asyncio.timeout(10):
            async for entry in events:
                assert isinstance(entry.msg, Event)
                got.append(entry.msg)
                if len(got) == 2:
                    break
    finally:
        follower.cancel()
    by = {e.migration: e for e in got}
    assert by["m-1"].event is EventKind.RESUMED and by["m-1"].request == rid
    assert by["m-2"].event is EventKind.REFUSED
    assert rid in b.ids and rid not in a.ids
    assert (stats.moved, stats.refused) == (1, 1)


def test_small_run_of_a_real_scheduler(capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser()
    configure(parser)
    args = parser.parse_args(
        [
            *("--instances", "16", "--duration", "10", "--sample-s", "2", "--json"),
            *("--no-progress", "--scheduler-set", "scheduler.gc_gen0_threshold=20000"),
        ]
    )
    assert run(args) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["instances"] == 16 and r["duration_s"] >= 10
    # The generator kept its rate (16 instances x ~2 reports/s).
    assert r["reports_per_s"] == pytest.approx(r["reports_per_s_target"], rel=0.25)
    assert 20 < r["reports_per_s_target"] < 40
    # The scheduler ticked (slots skipped only under heavy load), and measured its ticks.
    assert 0.5 * r["ticks_expected"] <= r["ticks"] <= r["ticks_expected"] + 2
    assert 0 < r["tick_p50_ms"] <= r["tick_p99_ms"] < 2500
    assert r["decisions_published"] > 0  # the imbalance was planned on
    # The emulated fleet carried the decisions out: the moves resolved.
    assert r["moves_followed"]["resumed"] > 0
    assert set(r["tick_phase_p50_p99_ms"]) == {"view", "plan", "publish"}
    assert all(0 < p50 <= p99 for p50, p99 in r["tick_phase_p50_p99_ms"].values())
    assert r["streams_bounded"] and not r["lag_grows"]
    assert r["redis_used_memory_mib_max"] > 0 and r["redis_cpu_pct"] > 0
    assert r["scheduler_cpu_pct"] > 0
    assert r["scheduler_set"] == ["scheduler.gc_gen0_threshold=20000"]
    assert r["reports_read_per_s"] > 0 and r["scheduler_cpu_ms_per_report_read"] > 0
    assert len(r["samples"]) >= 4 and all("lag_s" in s for s in r["samples"])
    assert np.isfinite(r["lag_s_slope_per_min"])
    costs = r["cpu_costs"]
    assert costs["report_decode_apply_ms"] > 0 and costs["tick_plan_ms"] > 0
    assert costs["tick_cpu_ms"] == pytest.approx(
        costs["tick_instances_ms"] + costs["tick_plan_ms"] + costs["tick_load_ms"], abs=0.05
    )
    assert 0 < costs["cpu_demand"] < 1  # 16 instances: a fraction of a core


def _verdict(lag_s: list[float], lag: list[int]) -> dict[str, object]:
    parser = argparse.ArgumentParser()
    configure(parser)
    args = parser.parse_args(["--instances", "4", "--duration", "60"])
    samples = [
        {
            "t": 5.0 * (i + 1),
            "lag_s": s,
            "lag": n,
            "entries_read": 1000 + 8 * (i + 1) * 5,  # 8 reports/s read
            "pending": 0,
            "lengths": {"reports": 100, "decisions": 1, "events": 1},
            "used_memory": 1,
            "load1": 1.0,
            "live": 4,
            "leader": 1,
        }
        for i, (s, n) in enumerate(zip(lag_s, lag, strict=True))
    ]
    hist = {
        "buckets": {0.01: 240.0, math.inf: 240.0},
        "phases": {p: {0.01: 240.0, math.inf: 240.0} for p in PHASES},
        "ticks": 240.0,
        "tick_sum": 1.0,
        "decided": 3.0,
    }
    zero = {
        "buckets": {},
        "phases": {p: {} for p in PHASES},
        "ticks": 0.0,
        "tick_sum": 0.0,
        "decided": 0.0,
        "entries_read": 1000,
    }
    return summarise(
        args, Settings(), zero, hist, samples, 60.0, 1.0, 480, {"redis": 0, "scheduler": 0},
        {"redis": 1, "scheduler": 6}, GenStats(),
    )  # fmt: skip


def test_lag_verdict() -> None:
    steady = _verdict([0.01, 0.05, 0.02, 0.04] * 3, [3, 8, 1, 5] * 3)
    assert not steady["lag_grows"] and steady["tick_p99_ok"] and steady["streams_bounded"]
    assert steady["scheduler_cpu_pct"] == 10.0 and steady["decisions"] == 3
    # 480 reports read in 60 s on 6 CPU-s: the scheduler's cost per report,
    # whatever share of a core the machine's load left it.
    assert steady["reports_read_per_s"] == 8.0
    assert steady["scheduler_cpu_ms_per_report_read"] == 12.5
    # Falling behind: the lag in seconds grows.
    assert _verdict([0.1 * i for i in range(12)], [50 * i for i in range(12)])["lag_grows"]
    # Far behind with MAXLEN trimming unread entries: lag_s shrinks, entries grow.
    assert _verdict([40.0 - i for i in range(12)], [60_000 + 5000 * i for i in range(12)])[
        "lag_grows"
    ]


def test_registered_as_star_bench_scheduler(capsys: pytest.CaptureFixture[str]) -> None:
    from star.cli.main import main

    with pytest.raises(SystemExit) as exit_:
        main(["bench", "scheduler", "--help"])
    assert exit_.value.code == 0
    assert "--instances" in capsys.readouterr().out
