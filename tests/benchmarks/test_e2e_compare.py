"""The paired comparison of ``star bench e2e`` (benchmarks/e2e/compare.py), on made-up cells."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import benchmarks.e2e as e2e
from benchmarks.e2e.compare import (
    ATTAINMENT,
    LENGTH_MATCH_MIN,
    Arm,
    _ratio,
    capacity,
    compare,
    comparison_rows,
    comparison_table,
)
from benchmarks.e2e.report import cell_of, write_cell

SLO = (1000.0, 25.0)


def _requests(
    tpot_ms: list[float], lengths: list[int] | None = None, ttft_s: float = 0.1
) -> list[dict[str, Any]]:
    """Requests sent 1 s apart: the steady-state window holds those sent from 10 % to 90 %
    of the span, i.e. the middle 80 % of them."""
    lengths = lengths or [100] * len(tpot_ms)
    return [
        {
            "index": str(i),
            "sent_s": str(float(i)),
            "ok": "True",
            "output_tokens": str(n),
            "ttft_s": str(ttft_s),
            "tpot_s": str(t / 1e3),
        }
        for i, (t, n) in enumerate(zip(tpot_ms, lengths, strict=True))
    ]


def _row(mode: str, seed: int, rate: float = 3.0, **extra: Any) -> dict[str, Any]:
    return {"regime": "device", "rate": rate, "mode": mode, "seed": seed, **extra}


def _doc(row: dict[str, Any]) -> dict[str, Any]:
    return {"row": row, "config": {"regime": {"slo_ttft_ms": SLO[0], "slo_tpot_ms": SLO[1]}}}


def _arm(seed: int, tpot_ms: list[float], lengths: list[int] | None = None) -> Arm:
    return Arm.from_cell(_row("x", seed), _requests(tpot_ms, lengths), SLO)


def _tpots(seed: int, n: int = 400, scale: float = 1.0) -> list[float]:
    rng = np.random.default_rng(seed)
    return [float(x) * scale for x in 10 + rng.exponential(5, n)]


def test_the_window_leaves_out_ramp_up_and_drain() -> None:
    arm = _arm(1, [10.0] * 101)  # sent at 0 .. 100 s
    assert arm.inside == tuple(range(10, 91)) and (arm.ramp, arm.drain) == (10, 10)
    out = compare([arm], [arm], bootstrap=5)
    assert (out["requests"], out["ramp_excluded"], out["drain_excluded"]) == (81, 10, 10)


def test_identical_arms_are_a_ratio_of_one_and_not_significant() -> None:
    base = [_arm(s, _tpots(s)) for s in (1, 2, 3)]
    same = [_arm(s, _tpots(s)) for s in (1, 2, 3)]
    out = compare(base, same, bootstrap=300)
    assert out["p99_tpot_ratio"] == 1.0 and out["length_match"] == 1.0
    assert out["p99_tpot_ratio_low"] == out["p99_tpot_ratio_high"] == 1.0  # paired: no spread
    assert out["significant"] is False and "not significant" in out["note"]
    assert out["seeds"] == 3 and out["requests"] == 3 * 320


def test_a_halved_tail_is_significant_and_its_interval_holds_the_point() -> None:
    base = [_arm(s, _tpots(s)) for s in (1, 2, 3, 4, 5)]
    half = [_arm(s, _tpots(s, scale=0.5)) for s in (1, 2, 3, 4, 5)]
    out = compare(base, half, bootstrap=300)
    assert out["p99_tpot_ratio"] == pytest.approx(0.5)
    assert out["p99_tpot_ratio_low"] <= 0.5 <= out["p99_tpot_ratio_high"] < 1.0
    assert out["significant"] is True and out["note"] == ""


def test_the_p99_is_pooled_over_seeds_not_averaged() -> None:
    # Seed 1's tail is one request; pooled over both seeds' windows, P99 sits between.
    spike = [10.0] * 50 + [1000.0] + [10.0] * 50
    base = [_arm(1, spike), _arm(2, [10.0] * 101)]
    out = compare(base, base, bootstrap=10)
    pooled = np.percentile([10.0] * 161 + [1000.0], 99)
    assert out["requests"] == 162 and out["p99_tpot_ms"] == pytest.approx(pooled)
    averaged = (np.percentile([10.0] * 80 + [1000.0], 99) + 10.0) / 2
    assert out["p99_tpot_ms"] != pytest.approx(averaged)


def test_arms_with_other_output_lengths_are_not_compared() -> None:
    n = 101
    inside = 81
    mismatched = int(inside * (1 - LENGTH_MATCH_MIN)) + 1
    lengths = [100] * n
    for i in range(40, 40 + mismatched):  # inside the window
        lengths[i] = 7
    out = compare([_arm(1, _tpots(1, n))], [_arm(1, _tpots(1, n), lengths)], bootstrap=10)
    assert out["length_match"] == pytest.approx((inside - mismatched) / inside)
    assert out["p99_tpot_ratio"] is None and out["significant"] is None
    assert "did not serve the same work" in out["note"]


def test_only_requests_both_arms_completed_are_paired() -> None:
    base_rows = _requests([10.0] * 11)
    arm_rows = _requests([10.0] * 11)
    arm_rows[5]["ok"] = "False"
    out = compare(
        [Arm.from_cell(_row("a", 1), base_rows, SLO)],
        [Arm.from_cell(_row("b", 1), arm_rows, SLO)],
        bootstrap=10,
    )
    assert out["requests"] == 8 and out["length_match"] == 1.0  # 9 in the window, one failed


@pytest.mark.parametrize(
    ("points", "expected"),
    [
        ([(1.0, 1.0), (2.0, 0.95), (3.0, 0.85)], (2.5, "interpolated")),
        ([(3.0, 0.7), (1.0, 0.99), (2.0, 0.93)], (2.0 + 0.03 / 0.23, "interpolated")),
        ([(1.0, 0.99), (2.0, 0.91)], (2.0, ">=")),
        ([(1.0, 0.5), (2.0, 0.99)], (None, "below the sweep")),
        ([], (None, "no rates")),
        # the walk stops at the first rate that fails, whatever comes after
        ([(1.0, 0.95), (2.0, 0.8), (3.0, 0.95)], (1.0 + 0.05 / 0.15, "interpolated")),
    ],
)
def test_capacity_goodput_rule(
    points: list[tuple[float, float]], expected: tuple[float | None, str]
) -> None:
    cap, how = capacity(points)
    assert how == expected[1]
    assert cap == (None if expected[0] is None else pytest.approx(expected[0]))
    assert ATTAINMENT == 0.9


def test_rows_count_completed_migrations_apart_from_decisions() -> None:
    cells = []
    for seed in (1, 2):
        base = _row("no-migration", seed, preemptions=4)
        cells.append((_doc(base), _requests(_tpots(seed, 51))))
        pred = _row(
            "predicted",
            seed,
            preemptions=1,
            decisions=5,
            migrations=3,
            migration_outcomes={"resumed": 3, "refused": 2},
        )
        cells.append((_doc(pred), _requests(_tpots(seed, 51, scale=0.9))))
    rows = comparison_rows(cells, bootstrap=50)
    assert [r["mode"] for r in rows] == ["no-migration", "predicted"]
    base, pred = rows
    assert base["p99_tpot_ratio"] == 1.0 and base["note"] == "baseline"
    assert (pred["preemptions"], pred["baseline_preemptions"]) == (2, 8)
    assert (pred["migrations_completed"], pred["decisions"]) == (6, 10)
    assert pred["p99_tpot_ratio"] == pytest.approx(0.9)
    text = comparison_table(rows)
    assert "| device | 1P+3D | 3 | predicted | 2 | 82 | 100% |" in text
    assert "| 6 / 10 |" in text


def test_p99_ttft_is_compared_pair_by_pair_like_tpot() -> None:
    base = [Arm.from_cell(_row("x", s), _requests(_tpots(s), ttft_s=0.2), SLO) for s in (1, 2)]
    quick = [Arm.from_cell(_row("x", s), _requests(_tpots(s), ttft_s=0.1), SLO) for s in (1, 2)]
    out = compare(base, quick, bootstrap=50)
    assert out["p99_ttft_ratio"] == pytest.approx(0.5)
    assert out["p99_ttft_ratio_low"] == pytest.approx(0.5)
    assert out["p99_ttft_ratio_high"] == pytest.approx(0.5)
    assert (out["baseline_p99_ttft_ms"], out["pooled_p99_ttft_ms"]) == pytest.approx((200, 100))
    assert out["p99_tpot_ratio"] == pytest.approx(1.0)


def test_baseline_preemptions_count_only_the_seeds_a_mode_ran() -> None:
    cells = []
    for seed, preemptions in ((1, 81), (2, 120), (3, 117)):
        base = _row("no-migration", seed, preemptions=preemptions)
        cells.append((_doc(base), _requests(_tpots(seed, 51))))
    current = _row("current", 1, preemptions=7)
    cells.append((_doc(current), _requests(_tpots(1, 51, scale=0.9))))
    base, cur = comparison_rows(cells, bootstrap=50)
    assert (base["preemptions"], cur["preemptions"], cur["baseline_preemptions"]) == (318, 7, 81)
    assert "| 7 (81) |" in comparison_table([base, cur])


def test_fleet_shapes_are_compared_apart(tmp_path: Path) -> None:
    small = {"prefill": 1, "decode": 3}
    large = {"prefill": 2, "decode": 6}

    def cell(mode: str, seed: int, shape: dict[str, int], scale: float) -> tuple[Any, Any]:
        doc = _doc(_row(mode, seed))
        doc["config"] |= shape
        return doc, _requests(_tpots(seed, 51, scale=scale))

    cells = [cell("no-migration", s, small, 1.0) for s in (1, 2)]
    cells += [cell("predicted", s, small, 0.8) for s in (1, 2)]
    cells += [cell("predicted", s, large, 0.5) for s in (1, 2)]  # no large baseline
    rows = comparison_rows(cells, bootstrap=20)
    shapes = [(r["cluster"], r["mode"]) for r in rows]
    assert shapes == [("1P+3D", "no-migration"), ("1P+3D", "predicted"), ("2P+6D", "predicted")]
    assert rows[1]["p99_tpot_ratio"] == pytest.approx(0.8)  # paired with its own shape only
    assert rows[2].get("p99_tpot_ratio") is None and rows[2]["note"] == "no baseline"
    # A results directory holds one shape: adding another's cells is refused.
    write_cell(tmp_path, cell_of(cells[0][0]), cells[0][0], cells[0][1])
    e2e._one_shape(tmp_path, "1P+3D")
    with pytest.raises(ValueError, match="cells of a 1P\\+3D fleet and this run is 2P\\+6D"):
        e2e._one_shape(tmp_path, "2P+6D")


def test_capacity_goodput_over_a_rate_sweep() -> None:
    # At each rate a share of the window misses the TPOT SLO (25 ms): the baseline
    # crosses 90 % between 2 and 3 req/s, STAR between 3 and 4.
    def cell(mode: str, rate: float, seed: int, missing: float) -> tuple[Any, Any]:
        bad = set(range(10, 10 + round(missing * 81)))
        tpots = [40.0 if i in bad else 10.0 for i in range(101)]
        return _doc(_row(mode, seed, rate)), _requests(tpots)

    miss = {
        "no-migration": {1.0: 0.0, 2.0: 0.05, 3.0: 0.3, 4.0: 0.5},
        "predicted": {1.0: 0.0, 2.0: 0.0, 3.0: 0.05, 4.0: 0.3},
    }
    cells = [
        cell(mode, rate, seed, share)
        for mode, by_rate in miss.items()
        for rate, share in by_rate.items()
        for seed in (1, 2)
    ]
    rows = comparison_rows(cells, bootstrap=20)
    base = next(r for r in rows if r["mode"] == "no-migration")
    pred = next(r for r in rows if r["mode"] == "predicted")
    hold, fail = 1 - round(0.05 * 81) / 81, 1 - round(0.3 * 81) / 81
    step = (hold - ATTAINMENT) / (hold - fail)
    assert base["capacity_goodput_rps"] == pytest.approx(2.0 + step)
    assert (pred["capacity_goodput_rps"], pred["capacity_found"]) == (
        pytest.approx(3.0 + step),
        "interpolated",
    )
    assert pred["capacity_goodput_ratio"] == pytest.approx((3.0 + step) / (2.0 + step))
    low, high = pred["capacity_goodput_ratio_low"], pred["capacity_goodput_ratio_high"]
    assert low <= pred["capacity_goodput_ratio"] <= high
    assert f"| {3.0 + step:.2f} | {pred['capacity_goodput_ratio']:.2f} [" in comparison_table(rows)


def test_no_capacity_ratio_unless_the_sweep_crosses_the_target_in_both_arms() -> None:
    cells = [
        (_doc(_row(mode, 1, rate)), _requests([10.0] * 51))
        for mode in ("no-migration", "predicted")
        for rate in (1.0, 2.0)
    ]
    pred = next(r for r in comparison_rows(cells, bootstrap=5) if r["mode"] == "predicted")
    assert (pred["capacity_goodput_rps"], pred["capacity_found"]) == (2.0, ">=")
    assert pred["capacity_goodput_ratio"] is None
    assert pred["capacity_note"] == "no ratio: the sweep does not find both capacities"


def test_a_mode_without_its_baseline_says_so() -> None:
    rows = comparison_rows([(_doc(_row("predicted", 1)), _requests([10.0] * 11))], bootstrap=5)
    assert rows[0]["note"] == "no baseline" and rows[0].get("p99_tpot_ratio") is None
    assert rows[0]["slo_attainment"] == 1.0
    assert math.isnan(rows[0]["p99_ttft_ms"])


@pytest.mark.parametrize(
    ("low", "high", "shown"),
    [
        (0.9997, 1.017, "1.01 [1.00, 1.02] n.s."),  # rounded it reads as if it excluded 1.0
        (1.002, 1.017, "1.01 [1.00, 1.02]"),
        (0.62, 0.89, "1.01 [0.62, 0.89]"),
        (None, None, "1.01"),
    ],
)
def test_a_ratio_whose_interval_holds_one_says_not_significant(
    low: float | None, high: float | None, shown: str
) -> None:
    row = {"mode": "current", "r": 1.009, "r_low": low, "r_high": high}
    assert _ratio(row, "r") == shown
