"""``star bench e2e``'s pure parts: workloads, regimes, metrics, the results folder and table."""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from benchmarks.e2e import cell_line, metrics, report
from benchmarks.e2e.metrics import RequestRecord, instance_series
from benchmarks.e2e.regimes import VLLM_RESERVE_TOKENS, kv_capacity, regime
from benchmarks.e2e.report import Cell
from benchmarks.e2e.workload import Workload, replay_lengths, schedule, size_for_length
from benchmarks.serve import Slo
from star.wire import Decision, Event, EventKind, Report, RequestLoad
from workers.pacing import DeviceClock, StepTimes, batch_tokens

# -- workloads -------------------------------------------------------------------------


def test_replay_lengths_are_shaped_like_table_3() -> None:
    cap = 1024
    x = replay_lengths(50_000, np.random.default_rng(0), cap)
    assert x.min() >= 1 and x.max() <= cap
    # Table 3 (ShareGPT, 32K cap): P50 1,536 (4.7 % of the cap), mean 7,542 (23 %),
    # over 15 % of answers past 25K; P90 and P95 at the cap.
    assert abs(np.median(x) / cap - 1536 / 32768) < 0.005
    assert abs(x.mean() / cap - 7542 / 32768) < 0.02
    assert 0.15 <= (x >= 0.95 * cap).mean() <= 0.18
    assert np.percentile(x, 90) >= 0.95 * cap


@pytest.mark.parametrize(
    ("tokens", "size"),
    [(1, "tiny"), (10, "tiny"), (30, "short"), (90, "medium"), (250, "long"), (1000, "huge")],
)
def test_replay_prompt_size_follows_the_length(tokens: int, size: str) -> None:
    assert size_for_length(tokens) == size


def test_a_seed_gives_the_same_schedule_in_every_mode() -> None:
    w = Workload("replay")
    a, ta = schedule(w, 30, 2.0, seed=5)
    b, tb = schedule(w, 30, 2.0, seed=5)
    c, _ = schedule(w, 30, 2.0, seed=6)
    assert a == b and ta == tb
    assert a != c
    assert ta[0] == 0.0 and all(y >= x for x, y in itertools.pairwise(ta))
    assert all(1 <= r.max_tokens <= w.cap for r in a)


def test_which_workloads_know_their_lengths() -> None:
    greedy = {"temperature": 0.0}  # paired by construction: the same lengths in every mode
    assert Workload("replay").known_lengths
    assert Workload("replay").extra == {**greedy, "ignore_eos": True}
    assert not Workload("task").known_lengths and Workload("task").extra == greedy
    assert Workload("sharegpt.json").known_lengths


def test_sharegpt_workload(tmp_path: Path) -> None:
    path = tmp_path / "sg.json"
    path.write_text(
        json.dumps(
            [
                {
                    "conversations": [
                        {"from": "human", "value": "hi there"},
                        {"from": "gpt", "value": "a b c d"},
                    ]
                }
            ]
        )
    )
    reqs = Workload(str(path), cap=3).requests(
        2, np.random.default_rng(0), lambda t: len(t.split())
    )
    assert [r.max_tokens for r in reqs] == [3, 3]  # 4 answer tokens, capped at 3


@pytest.mark.parametrize(
    ("workload", "n", "error"),
    [
        (Workload("replay"), 0, "at least 1 request"),
        (Workload("replay", cap=1), 3, "cap must be >= 2"),
        (Workload("/no/such/file.json"), 3, "expected task, replay or a ShareGPT JSON file"),
    ],
)
def test_bad_workloads_say_why(workload: Workload, n: int, error: str) -> None:
    with pytest.raises(ValueError, match=error):
        workload.requests(n, np.random.default_rng(0))


# -- regimes -------------------------------------------------------------------------------


def test_kv_capacity_rule() -> None:
    # 2 x (1,024 + 64 prompt allowance) = 2,176 tokens = 17 blocks of 128, above the floor.
    assert kv_capacity(1024, 2.0, 2048) == 2176
    assert kv_capacity(100, 2.0, 2048) == 2176  # vLLM needs a block more than max_model_len
    assert kv_capacity(1000, 1.5, 1024) == 1664  # 1,596 rounded up to whole blocks
    with pytest.raises(ValueError, match="kv_requests must be > 0"):
        kv_capacity(1024, 0.0, 2048)


def test_regimes_settings() -> None:
    mem = regime("memory", 1024)
    dev = regime("device", 1024)
    assert not mem.emulated and mem.label == "real timing"
    assert "STAR_WORKER_DEVICE_STEP_MS" not in mem.env(1024)
    assert dev.emulated and dev.label == "emulated device timing"
    assert mem.kv_tokens == 2176  # 2 x the largest request, in 128-token blocks
    # The device's KV is the card's 200,000 tokens compressed by 32,768 / 1,024 = 32.
    assert dev.kv_tokens == 6272  # 6,250 in whole blocks
    env = dev.env(1024)
    assert float(env["STAR_WORKER_KV_CACHE_SPACE_GIB"]) * 2**30 == pytest.approx(
        (6272 + VLLM_RESERVE_TOKENS) * 1024
    )
    # The emulated step: 8 ms + 20 ms at the card's full KV; 18 ms at half (§5.3's 18.23 ms).
    clock = DeviceClock(dev.step_base_ms / 1e3, dev.step_us_per_token / 1e6)
    assert clock.step_s(6250 // 2, 0) == pytest.approx(0.018)
    assert clock.step_s(6250, 0) == pytest.approx(0.028)
    assert (dev.slo_ttft_ms, dev.slo_tpot_ms) == (1000.0, 25.0)  # paper §6.2
    # Prefill, recompute and pulls at the card's price per token (0.125 ms; 57,344 B at 25 Gbit/s).
    assert dev.prefill_us_per_token == pytest.approx(125.0)
    assert dev.transfer_us_per_token == pytest.approx(57_344 * 8 / 25e9 * 1e6)
    assert float(env["STAR_WORKER_DEVICE_TRANSFER_US_PER_TOKEN"]) == pytest.approx(
        dev.transfer_us_per_token, rel=1e-5
    )
    with pytest.raises(ValueError, match="unknown regime"):
        regime("gpu", 1024)
    with pytest.raises(ValueError, match="need max_model_len >= 2064"):
        regime("memory", 2000, max_model_len=2048)
    with pytest.raises(ValueError, match="lower --max-model-len or raise --cap"):
        regime("device", 100, max_model_len=1024)  # 610 tokens of KV for 1,024


def test_one_compression_and_one_dilation_scale_every_device_cost() -> None:
    from benchmarks.e2e.device import DeviceCard, Emulation

    card = DeviceCard.paper()
    one, slow = Emulation(card, 512), Emulation(card, 512, dilation=4.0)
    assert one.compression == 64.0 and one.kv_tokens == 200_000 // 64
    # A full instance steps as slowly as the card's (8 + 20 ms): KV / c, per KV token x c.
    full_step_ms = one.step_base_ms + one.step_us_per_token * one.kv_tokens / 1e3
    assert full_step_ms == pytest.approx(8.0 + 0.1e-3 * 200_000, rel=1e-3)
    # The longest answer's recompute and move weigh against its life (cap steps of
    # 18 ms at half KV) as on the card (32,768 steps): both are 1 / c of the card's.
    life_ms, card_life_ms = 512 * 18.0, 32_768 * 18.0
    recompute_ms = one.prefill_us_per_token * 512 / 1e3
    assert recompute_ms / life_ms == pytest.approx(0.125 * 32_768 / card_life_ms)
    move_ms = one.transfer_us_per_token * 512 / 1e3
    assert move_ms / life_ms == pytest.approx(57_344 * 32_768 * 8 / 25e9 * 1e3 / card_life_ms)
    # Dilation: every time and SLO x d, the capacity and the compression unchanged.
    for name in ("step_base_ms", "step_us_per_token", "prefill_us_per_token",
                 "transfer_us_per_token", "slo_ttft_ms", "slo_tpot_ms"):  # fmt: skip
        assert getattr(slow, name) == pytest.approx(4.0 * getattr(one, name))
    assert (slow.kv_tokens, slow.compression) == (one.kv_tokens, one.compression)
    assert slow.describe()["dilation"] == 4.0
    with pytest.raises(ValueError, match="dilation must be >= 1"):
        Emulation(card, 512, dilation=0.5)


# -- the pacer's arithmetic ----------------------------------------------------------------


def test_batch_tokens_counts_kv_and_prefill() -> None:
    out = SimpleNamespace(
        num_scheduled_tokens={"new": 30, "a": 1, "b": 1, "re": 200},
        scheduled_new_reqs=[SimpleNamespace(req_id="new", num_computed_tokens=0)],
        scheduled_cached_reqs=SimpleNamespace(
            req_ids=["a", "b", "re"], num_computed_tokens=[100, 50, 0]
        ),
    )
    # KV: 30 + 101 + 51 + 200; prefilled: the new prompt's 30 and the recompute's 199.
    assert batch_tokens(out) == (382, 229)


def test_step_times_since() -> None:
    a, b = StepTimes(10, 0.2, 0.1), StepTimes(30, 0.6, 0.4)
    assert b.since(a) == (pytest.approx(0.02), pytest.approx(0.75))
    assert a.since(a) == (None, 0.0)


# -- metrics -------------------------------------------------------------------------------


def _report(
    inst: str,
    seq: int,
    ts: float,
    *,
    used: int,
    running: int,
    step_s: float,
    preempt: int = 0,
    cap: int = 1000,
    pad: float = 0.0,
) -> Report:
    return Report(
        instance=inst,
        role="decode",
        seq=seq,
        ts=ts,
        address="x",
        capacity_tokens=cap,
        used_tokens=used,
        bytes_per_token=1,
        step_time_s=step_s,
        delta=32,
        trace=[float(used)],
        requests=[RequestLoad(f"{inst}-{i}", 10, 1) for i in range(running)],
        preemptions=preempt,
        pad_share=pad,
    )


def _fleet() -> dict[str, metrics.InstanceSeries]:
    t0 = 100.0
    reports = [
        _report("d0", 1, t0 + 0.5, used=900, running=3, step_s=0.030, preempt=2, pad=0.5),
        _report("d0", 2, t0 + 1.5, used=995, running=3, step_s=0.030, preempt=5, pad=0.5),
        _report("d1", 1, t0 + 0.5, used=100, running=1, step_s=0.010, pad=0.7),
        _report("d1", 2, t0 + 1.5, used=0, running=0, step_s=0.010, pad=0.0),
        Report(
            instance="p0",
            role="prefill",
            seq=1,
            ts=t0 + 0.5,
            address="x",
            capacity_tokens=1,
            used_tokens=0,
            bytes_per_token=1,
            step_time_s=0.5,
            delta=32,
            trace=[0.0],
            requests=[],
        ),
    ]
    return instance_series(reports, t0)


def test_time_series_from_reports() -> None:
    series = _fleet()
    assert set(series) == {"d0", "d1"}  # decode instances only
    # Bin 0: step times 30 and 10 ms -> variance 100 ms^2; bin 1: 30 and 0 (idle) -> 225.
    assert metrics.variance_over_time(series, 2.0) == [100.0, 225.0]
    assert metrics.max_kv_over_time(series, 2.0) == [0.9, 0.995]
    assert metrics.fleet_kv_over_time(series, 2.0) == [0.5, 0.4975]
    # vLLM's counter is cumulative: 3 happened during the run, in the second second.
    assert metrics.preemptions(series) == 3
    assert metrics.preemption_bins(series, 2.0) == [0, 3]


def _rec(i: int, ok: bool = True, ttft: float = 0.1, tpot: float | None = 0.02) -> RequestRecord:
    return RequestRecord(
        index=i,
        request_id=f"r{i}",
        sent_s=0.0,
        ok=ok,
        max_tokens=10,
        output_tokens=10 if ok else 0,
        ttft_s=ttft,
        e2e_s=1.0,
        tpot_s=tpot,
        error="" if ok else "HTTP 500",
    )


def test_summary_counts_goodput_by_the_slo() -> None:
    records = [
        _rec(0),
        _rec(1, tpot=0.03),
        _rec(2, ttft=2.0),
        _rec(3, ok=False),
        _rec(4, tpot=None),
    ]
    decisions = [
        Decision("m1", "r0", "d0", "d1", 1, -5.0, "predicted", 100.2),
        Decision("m2", "r1", "d0", "d1", 1, -4.0, "predicted", 100.3),
    ]
    events = [
        Event(EventKind.RESUMED, 100.3, "proxy", request="r0", migration="m1"),
        Event(EventKind.REFUSED, 100.4, "proxy", request="r1", migration="m2"),
    ]
    row = metrics.summarize(records, _fleet(), decisions, events, 2.0, Slo(1000.0, 25.0))
    assert row["completed"] == 4 and row["failed"] == 1
    assert row["goodput"] == 1.0  # r0 and r4 (single-token TPOT) met both SLOs, over 2 s
    assert row["slo_met"] == pytest.approx(2 / 5)
    assert row["throughput"] == 2.0
    assert row["preemptions"] == 3
    assert (row["migrations"], row["decisions"]) == (1, 2)  # the refused one is no migration
    assert row["migration_outcomes"] == {"resumed": 1, "refused": 1}
    assert row["exec_time_variance"] == pytest.approx(162.5)
    assert row["max_kv_use"] == pytest.approx(0.995) and row["kv_capacity"] == 1000
    assert row["fleet_kv_peak"] == pytest.approx(0.5)
    assert row["pad_share"] == pytest.approx((0.5 + 0.5 + 0.7) / 3)  # while running only
    assert metrics.migrations_per_request(events) == {"r0": 1}


def test_interval_over_seeds() -> None:
    mean, lo, hi = metrics.interval([1.0, 2.0, 3.0])
    assert (
        mean == 2.0
        and lo == pytest.approx(2 - 2.4841, abs=1e-3)
        and hi == pytest.approx(2 + 2.4841, abs=1e-3)
    )
    assert metrics.interval([4.0]) == (4.0, 4.0, 4.0)
    assert all(math.isnan(v) for v in metrics.interval([]))


# -- the results folder and the table ------------------------------------------------------


def _doc(mode: str, seed: int, p99: float, goodput: float, rate: float = 2.0) -> dict[str, object]:
    row = {k: 0.0 for k in report.ROW_KEYS}
    row |= {
        "regime": "device",
        "workload": "replay",
        "mode": mode,
        "rate": rate,
        "seed": seed,
        "p99_tpot_ms": p99,
        "goodput": goodput,
        "timing": "emulated device timing",
        "slo_met": 1.0,
    }
    return {"row": row}


def test_cells_are_written_once_and_found_again(tmp_path: Path) -> None:
    cell = report.Cell("device", "predicted", 2.0, 1)
    assert report.load_cell(tmp_path, cell) is None
    report.write_cell(tmp_path, cell, _doc("predicted", 1, 20.0, 1.0), [{"index": 0, "ok": True}])
    assert report.load_cell(tmp_path, cell) == _doc("predicted", 1, 20.0, 1.0)
    assert (cell.path(tmp_path) / "requests.csv").read_text().splitlines() == ["index,ok", "0,True"]
    assert [d["row"]["mode"] for d in report.load_all(tmp_path)] == ["predicted"]
    assert not list(tmp_path.rglob("*.tmp"))


def test_aggregate_and_table() -> None:
    docs = [_doc("no-migration", s, 100.0, 1.0) for s in (1, 2)] + [
        _doc("predicted", 1, 20.0, 2.0),
        _doc("predicted", 2, 30.0, 3.0),
    ]
    aggs = report.aggregate([report.row(d) for d in docs])
    assert [a["mode"] for a in aggs] == ["no-migration", "predicted"]
    pred = aggs[1]
    assert pred["p99_tpot_ms"] == 25.0 and pred["seeds"] == 2
    assert pred["tpot_reduction"] == pytest.approx(0.75)
    assert pred["goodput_ratio"] == pytest.approx(2.5)
    text = report.table(aggs)
    assert "| device (emulated device timing) | 2 | predicted | 2 | 25.0 [" in text
    assert "| -75.0 % | 2.50 [" in text and "| 2.50× |" in text


def test_cell_paths_separate_everything() -> None:
    a = report.Cell("memory", "oracle", 2.5, 3)
    assert a.path(Path("o")) == Path("o/memory/oracle/rate-2.5/seed-3")
    assert dataclasses.replace(a, seed=4).path(Path("o")) != a.path(Path("o"))


def test_live_accuracy_and_sim_tables() -> None:
    def doc(mode: str, points: int, mae: float, sim_p99: float) -> dict[str, object]:
        d = _doc(mode, 1, 20.0, 1.0)
        d["predictor_live"] = {
            "points": points,
            "mae": mae,
            "buckets": [
                {"bucket": "0", "points": points, "mae": mae},
                {"bucket": "400+", "points": 0, "mae": None},
            ],
        }
        d["sim"] = {
            "p99_tpot_ms": sim_p99,
            "preemptions": 0,
            "exec_time_variance": 1.0,
            "migrations": 2,
        }
        return d

    docs = [
        doc("predicted", 10, 30.0, 22.0),
        doc("predicted", 30, 10.0, 22.0),
        doc("no-migration", 0, 0.0, 30.0),
    ]
    live = report.live_table(docs)
    # Points are pooled across cells: (10 x 30 + 30 x 10) / 40 = 15 tokens; no points, no row.
    assert "| device | predicted | 40 | 15 | 15 | - |" in live
    assert "no-migration" not in live
    sim = report.sim_table(docs)
    assert "| device | 2 | predicted | 20.0 / 22.0 | +10 % |" in sim
    assert "| device | 2 | no-migration | 20.0 / 30.0 | +50 % |" in sim


def test_a_cell_document_from_what_a_run_recorded() -> None:
    from benchmarks.e2e.cell import document
    from benchmarks.e2e.fleet import CellResult

    t0 = 100.0
    series_reports = [
        _report("d0", 1, t0 + 0.5, used=900, running=3, step_s=0.030, preempt=2, pad=0.5),
        _report("d0", 2, t0 + 1.5, used=995, running=3, step_s=0.030, preempt=5, pad=0.5),
    ]
    res = CellResult(
        records=[_rec(0), _rec(1, ok=False)],
        reports=series_reports,
        decisions=[Decision("m1", "r0", "d0", "d1", 1, -5.0, "predicted", t0 + 0.2)],
        events=[Event(EventKind.RESUMED, t0 + 0.3, "proxy", request="r0", migration="m1")],
        t0=t0,
        duration_s=2.0,
        ready_s=30.0,
    )
    reg = regime("device", 1024)
    doc, rows = document(
        report.Cell("device", "predicted", 2.5, 1), "replay", reg, res, {"cap": 1024}
    )
    assert doc["row"]["timing"] == "emulated device timing"
    assert (doc["row"]["mode"], doc["row"]["rate"], doc["row"]["workload"]) == (
        "predicted",
        2.5,
        "replay",
    )
    assert doc["row"]["preemptions"] == 3 and doc["row"]["migrations"] == 1
    assert doc["config"]["regime"]["kv_tokens"] == 6272 and doc["config"]["cap"] == 1024
    assert doc["series"]["migrations_t"] == [pytest.approx(0.2)]
    assert doc["series"]["preemptions"] == [0, 3]
    assert doc["events"][0]["event"] == "resumed" and doc["decisions"][0]["target"] == "d1"
    assert doc["predictor_live"]["points"] == 0 and doc["row"]["live_mae"] is None
    assert [r["migrations"] for r in rows] == [1, 0]  # r0 resumed once on another instance
    json.dumps(doc)  # JSON as written


def test_the_figures_draw_one_panel_per_mode_run(tmp_path: Path) -> None:
    from benchmarks.e2e.cell import document
    from benchmarks.e2e.figures import draw_all
    from benchmarks.e2e.fleet import CellResult

    t0 = 100.0
    reports = [
        _report("d0", 1, t0 + 0.5, used=900, running=3, step_s=0.030, preempt=2, pad=0.5),
        _report("d0", 2, t0 + 1.5, used=995, running=3, step_s=0.030, preempt=5, pad=0.5),
    ]
    res = CellResult([_rec(0), _rec(1)], reports, [], [], t0, 2.0, 30.0)
    docs = [
        document(report.Cell("device", mode, rate, 1), "task", regime("device", 600), res, {})[0]
        for mode in ("no-migration", "current", "predicted")
        for rate in (2.5, 3.0)
    ]
    paths = draw_all(docs, tmp_path / "img")
    assert [p.name for p in paths] == [
        "e2e-fig9.png",
        "e2e-fig10-variance.png",
        "e2e-fig11-kv.png",
    ]
    for p in paths:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # Fig. 11 has a column per mode that ran (3 here), not one per known mode.
    width = int.from_bytes(paths[2].read_bytes()[16:20], "big")
    assert width == round(4.2 * 3 * 110)


# -- the sweep's cells -----------------------------------------------------------------


def _sweep(**kw: object) -> SimpleNamespace:
    base = {"regimes": "memory,device", "modes": "no-migration,predicted", "seeds": "1"}
    return SimpleNamespace(**(base | {"rates": None, "quick": False} | kw))


def test_each_regime_sweeps_its_own_rates_unless_rates_are_given() -> None:
    from benchmarks.e2e import _cells
    from benchmarks.e2e.regimes import DEFAULT_RATES, QUICK_RATES

    cells = _cells(_sweep())
    for g in ("memory", "device"):
        assert sorted({c.rate for c in cells if c.regime == g}) == sorted(DEFAULT_RATES[g])
    assert len(cells) == 2 * 2 * 3
    quick = _cells(_sweep(quick=True))
    assert {(c.regime, c.rate) for c in quick} == {(g, QUICK_RATES[g]) for g in QUICK_RATES}
    # Memory pressure needs a higher rate than the padded device regime on this box.
    assert QUICK_RATES["memory"] > QUICK_RATES["device"]
    given = _cells(_sweep(rates="3,4"))
    assert {(c.regime, c.rate) for c in given} == {
        (g, r) for g in ("memory", "device") for r in (3.0, 4.0)
    }
    with pytest.raises(ValueError, match="--rates takes numbers"):
        _cells(_sweep(rates="fast"))
    # One command sweeps each regime at its own rates (argparse appends each --rates).
    each = _cells(_sweep(rates=["device=2.5,3", "memory=6"]))
    assert {(c.regime, c.rate) for c in each} == {("device", 2.5), ("device", 3.0), ("memory", 6.0)}
    only = _cells(_sweep(rates=["memory=5"]))
    assert {c.rate for c in only if c.regime == "device"} == set(DEFAULT_RATES["device"])
    with pytest.raises(ValueError, match="unknown regime 'gpu'"):
        _cells(_sweep(rates=["gpu=3"]))


# -- sim-to-real -------------------------------------------------------------------------


def _sim_doc(mode: str, stalls_ms: list[float]) -> dict[str, object]:
    reg = dataclasses.asdict(regime("device", 256, max_model_len=512))
    return {
        "row": {
            "regime": "device",
            "mode": mode,
            "rate": 2.0,
            "seed": 1,
            "duration_s": 20.0,
            "kv_capacity": reg["kv_tokens"],
        },
        "config": {"regime": reg, "decode": 3, "prefill": 1, "cap": 256, "bytes_per_token": 1024},
        "events": [{"event": "resumed", "data": {"stall_ms": s, "pull_ms": s}} for s in stalls_ms]
        + [{"event": "released", "data": {"tokens": 10}}],
    }


def _sim_records(n: int = 40) -> list[dict[str, str]]:
    # As requests.csv gives them back: strings.
    rng = np.random.default_rng(3)
    return [
        {
            "ok": "True",
            "prompt_tokens": str(int(rng.integers(15, 40))),
            "output_tokens": str(int(rng.choice([5, 20, 60, 250]))),
            "sent_s": f"{i * 0.5:.3f}",
        }
        for i in range(n)
    ]


def test_sim_to_real_prices_a_migration_at_the_measured_stall() -> None:
    from benchmarks.e2e.simreal import (
        DEFAULT_HANDOFF_S,
        measured_stall_s,
        pooled_stall_s,
        simulate_cell,
    )

    moved = _sim_doc("current", [40.0, 80.0, 300.0])
    still = _sim_doc("no-migration", [])
    assert measured_stall_s(moved) == pytest.approx(0.08)
    assert measured_stall_s(still) is None
    # One stall per regime, over every migration of its cells, for every mode.
    assert pooled_stall_s([moved, still, _sim_doc("oracle", [20.0])]) == {
        "device": pytest.approx(0.06)
    }
    sim = simulate_cell(moved, _sim_records())
    assert sim["migration_latency_s"] == pytest.approx(0.08) and sim["stall_measured"]
    assert sim["kv_block_tokens"] == 128
    assert sim["step_model"]["base_s"] == pytest.approx(0.008)  # the device regime's own
    assert set(sim) >= {"p99_tpot_ms", "preemptions", "exec_time_variance", "migrations"}
    assert sim["p99_tpot_ms"] >= 8.0  # no token faster than the padded step
    base = simulate_cell(still, _sim_records())
    assert base["migration_latency_s"] == DEFAULT_HANDOFF_S and not base["stall_measured"]
    assert base["migrations"] == 0
    assert simulate_cell(still, _sim_records(), 0.2)["migration_latency_s"] == 0.2
    assert simulate_cell(still, _sim_records(), blocks=False)["kv_block_tokens"] == 1
    assert simulate_cell(still, []) == {}


@pytest.mark.parametrize(
    ("extra", "tail"),
    [
        ({"failed": 0, "requests": 1250, "pad_share": 0.8712}, ", padding 87%"),
        ({"failed": 3, "requests": 1250, "pad_share": 0.65}, ", 3 of 1250 failed, padding 65%"),
        ({"failed": 0, "requests": 10, "pad_share": 0.0}, ", migrations 4"),  # real timing
    ],
)
def test_a_finished_cell_says_its_failures_and_padding(extra: dict[str, Any], tail: str) -> None:
    row = {"p99_tpot_ms": 97.29, "goodput": 2.331, "preemptions": 32, "migrations": 4, **extra}
    line = cell_line(Cell("device", "current", 11.0, 4), row)
    assert line.startswith("device current rate 11 seed 4: P99 TPOT 97.3 ms, goodput 2.33 req/s")
    assert line.endswith(tail)
