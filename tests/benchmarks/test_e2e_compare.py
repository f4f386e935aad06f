"""The paired comparison of ``star bench e2e`` (benchmarks/e2e/compare.py), on made-up cells."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest

from benchmarks.e2e.compare import LENGTH_MATCH_MIN, Arm, compare, comparison_rows, comparison_table


def _requests(tpot_ms: list[float], lengths: list[int] | None = None) -> list[dict[str, Any]]:
    lengths = lengths or [100] * len(tpot_ms)
    return [
        {"index": str(i), "ok": "True", "output_tokens": str(n), "tpot_s": str(t / 1e3)}
        for i, (t, n) in enumerate(zip(tpot_ms, lengths, strict=True))
    ]


def _row(mode: str, seed: int, **extra: Any) -> dict[str, Any]:
    return {"regime": "device", "rate": 3.0, "mode": mode, "seed": seed, **extra}


def _arm(seed: int, tpot_ms: list[float], lengths: list[int] | None = None) -> Arm:
    return Arm.from_cell(_row("x", seed), _requests(tpot_ms, lengths))


def _tpots(seed: int, n: int = 400, scale: float = 1.0) -> list[float]:
    rng = np.random.default_rng(seed)
    return [float(x) * scale for x in 10 + rng.exponential(5, n)]


def test_identical_arms_are_a_ratio_of_one_and_not_significant() -> None:
    base = [_arm(s, _tpots(s)) for s in (1, 2, 3)]
    same = [_arm(s, _tpots(s)) for s in (1, 2, 3)]
    out = compare(base, same, bootstrap=300)
    assert out["p99_tpot_ratio"] == 1.0 and out["length_match"] == 1.0
    assert out["p99_tpot_ratio_low"] == out["p99_tpot_ratio_high"] == 1.0  # paired: no spread
    assert out["significant"] is False and "not significant" in out["note"]
    assert out["seeds"] == 3 and out["requests"] == 1200


def test_a_halved_tail_is_significant_and_its_interval_holds_the_point() -> None:
    base = [_arm(s, _tpots(s)) for s in (1, 2, 3, 4, 5)]
    half = [_arm(s, _tpots(s, scale=0.5)) for s in (1, 2, 3, 4, 5)]
    out = compare(base, half, bootstrap=300)
    assert out["p99_tpot_ratio"] == pytest.approx(0.5)
    assert out["p99_tpot_ratio_low"] <= 0.5 <= out["p99_tpot_ratio_high"] < 1.0
    assert out["significant"] is True and out["note"] == ""


def test_the_p99_is_pooled_over_seeds_not_averaged() -> None:
    # Seed 1's tail is all in one request; pooled over 2 x 100 requests, P99 sits between.
    base = [_arm(1, [10.0] * 99 + [1000.0]), _arm(2, [10.0] * 100)]
    out = compare(base, base, bootstrap=10)
    pooled = np.percentile([10.0] * 199 + [1000.0], 99)
    assert out["p99_tpot_ms"] == pytest.approx(pooled)
    assert out["p99_tpot_ms"] != pytest.approx((np.percentile([10.0] * 99 + [1000.0], 99) + 10) / 2)


def test_arms_with_other_output_lengths_are_not_compared() -> None:
    n = 100
    mismatched = int(n * (1 - LENGTH_MATCH_MIN)) + 1
    base = [_arm(1, _tpots(1, n))]
    other = [_arm(1, _tpots(1, n), [100] * (n - mismatched) + [7] * mismatched)]
    out = compare(base, other, bootstrap=10)
    assert out["length_match"] == pytest.approx((n - mismatched) / n)
    assert out["p99_tpot_ratio"] is None and out["significant"] is None
    assert "did not serve the same work" in out["note"]


def test_only_requests_both_arms_completed_are_paired() -> None:
    base_rows = _requests([10.0, 20.0, 30.0])
    arm_rows = _requests([10.0, 20.0, 30.0])
    arm_rows[2]["ok"] = "False"
    out = compare(
        [Arm.from_cell(_row("a", 1), base_rows)],
        [Arm.from_cell(_row("b", 1), arm_rows)],
        bootstrap=10,
    )
    assert out["requests"] == 2 and out["length_match"] == 1.0


def test_rows_count_completed_migrations_apart_from_decisions() -> None:
    cells = []
    for seed in (1, 2):
        cells.append((_row("no-migration", seed, preemptions=4), _requests(_tpots(seed, 50))))
        cells.append(
            (
                _row(
                    "predicted",
                    seed,
                    preemptions=1,
                    decisions=5,
                    migrations=3,
                    migration_outcomes={"resumed": 3, "refused": 2},
                ),
                _requests(_tpots(seed, 50, scale=0.9)),
            )
        )
    rows = comparison_rows(cells, bootstrap=50)
    assert [r["mode"] for r in rows] == ["no-migration", "predicted"]
    base, pred = rows
    assert base["p99_tpot_ratio"] == 1.0 and base["note"] == "baseline"
    assert (pred["preemptions"], pred["baseline_preemptions"]) == (2, 8)
    assert (pred["migrations_completed"], pred["decisions"]) == (6, 10)
    assert pred["p99_tpot_ratio"] == pytest.approx(0.9)
    text = comparison_table(rows)
    assert "| device | 3 | predicted | 2 | 100 | 100% |" in text
    assert "| 6 / 10 |" in text


def test_a_mode_without_its_baseline_says_so() -> None:
    rows = comparison_rows([(_row("predicted", 1), _requests([10.0]))], bootstrap=5)
    assert rows[0]["note"] == "no baseline" and rows[0].get("p99_tpot_ratio") is None
    assert math.isnan(rows[0]["p99_ttft_ms"])
