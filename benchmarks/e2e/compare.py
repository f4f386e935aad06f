"""Each mode against ``no-migration``, paired request by request and pooled over seeds (pure).

Every mode of a seed serves the same requests (same prompts, arrival times
and, with greedy decoding, the same output lengths: :mod:`benchmarks.e2e.workload`),
so request ``i`` of seed ``s`` is one pair. Per (regime, rate, mode):

- ``length_match``: the share of pairs whose output lengths are equal. Below
  :data:`LENGTH_MATCH_MIN` the arms did not serve the same work and no ratio
  is reported (``note`` says why).
- ``p99_tpot_ms`` of each arm over the pairs of every seed pooled (with 5
  seeds of 1,000 requests, P99 rests on 50 requests, not one), and
  ``p99_tpot_ratio`` mode / baseline with a 95 % bootstrap interval: pairs
  resampled within each seed (the same pairs for both arms), B =
  :data:`BOOTSTRAP` times. ``significant`` is False whenever the interval
  holds 1.0.
- ``preemptions`` and ``migrations_completed`` summed over seeds (vLLM's
  counter; RESUMED moves, refused decisions apart in ``decisions``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

BASELINE = "no-migration"
LENGTH_MATCH_MIN = 0.95
BOOTSTRAP = 2000
PERCENTILE = 99.0


@dataclass(frozen=True, slots=True)
class Arm:
    """One cell's requests by schedule index: output length and TPOT (ms; NaN when none)."""

    seed: int
    lengths: Mapping[int, int]
    tpot_ms: Mapping[int, float]
    preemptions: int
    migrations: int
    decisions: int
    p99_ttft_ms: float

    @classmethod
    def from_cell(cls, row: Mapping[str, Any], requests: Sequence[Mapping[str, Any]]) -> Arm:
        """From a cell's row and its ``requests.csv`` rows (strings as written, or values)."""
        lengths: dict[int, int] = {}
        tpot: dict[int, float] = {}
        for r in requests:
            if str(r["ok"]) != "True":
                continue
            i = int(r["index"])
            lengths[i] = int(r["output_tokens"])
            raw = r.get("tpot_s")
            tpot[i] = float(raw) * 1e3 if raw not in (None, "") else math.nan
        return cls(
            seed=int(row["seed"]),
            lengths=lengths,
            tpot_ms=tpot,
            preemptions=int(row.get("preemptions") or 0),
            migrations=_completed(row),
            decisions=int(row.get("decisions", row.get("migrations")) or 0),
            p99_ttft_ms=float(row.get("p99_ttft_ms") or math.nan),
        )


def _completed(row: Mapping[str, Any]) -> int:
    outcomes = row.get("migration_outcomes") or {}
    return int(outcomes.get("resumed", 0))


def _pairs(base: Arm, arm: Arm) -> tuple[list[int], int]:
    """Indices both arms completed with a TPOT, and how many of them have equal lengths."""
    both = sorted(set(base.lengths) & set(arm.lengths))
    same = sum(base.lengths[i] == arm.lengths[i] for i in both)
    paired = [i for i in both if not math.isnan(base.tpot_ms[i]) and not math.isnan(arm.tpot_ms[i])]
    return paired, same if both else 0


def _p99(values: npt.NDArray[np.float64]) -> float:
    return float(np.percentile(values, PERCENTILE)) if values.size else math.nan


def compare(
    base: Sequence[Arm], arm: Sequence[Arm], seed: int = 0, bootstrap: int = BOOTSTRAP
) -> dict[str, Any]:
    """``arm`` against ``base`` over the seeds both ran (see the module docstring)."""
    by_seed = {a.seed: a for a in base}
    seeds = sorted(a.seed for a in arm if a.seed in by_seed)
    b_parts: list[npt.NDArray[np.float64]] = []
    a_parts: list[npt.NDArray[np.float64]] = []
    compared = same = 0
    for s in seeds:
        b, a = by_seed[s], next(x for x in arm if x.seed == s)
        paired, matched = _pairs(b, a)
        compared += len(set(b.lengths) & set(a.lengths))
        same += matched
        b_parts.append(np.array([b.tpot_ms[i] for i in paired], dtype=float))
        a_parts.append(np.array([a.tpot_ms[i] for i in paired], dtype=float))
    match = same / compared if compared else math.nan
    b_all = np.concatenate(b_parts) if b_parts else np.empty(0)
    a_all = np.concatenate(a_parts) if a_parts else np.empty(0)
    base_p99, arm_p99 = _p99(b_all), _p99(a_all)
    out: dict[str, Any] = {
        "seeds": len(seeds),
        "requests": int(b_all.size),
        "length_match": match,
        "p99_tpot_ms": arm_p99,
        "baseline_p99_tpot_ms": base_p99,
        "p99_tpot_ratio": None,
        "p99_tpot_ratio_low": None,
        "p99_tpot_ratio_high": None,
        "significant": None,
        "note": "",
    }
    if not seeds or not b_all.size:
        out["note"] = "no paired requests"
        return out
    if not match >= LENGTH_MATCH_MIN:
        out["note"] = (
            f"not compared: only {match:.0%} of the requests have the baseline's output length "
            f"(at least {LENGTH_MATCH_MIN:.0%} needed): the arms did not serve the same work"
        )
        return out
    ratio = arm_p99 / base_p99 if base_p99 > 0 else math.nan
    rng = np.random.default_rng(seed)
    ratios = np.empty(bootstrap)
    for k in range(bootstrap):
        picks = [rng.integers(0, p.size, p.size) for p in b_parts]
        rb = _p99(np.concatenate([p[i] for p, i in zip(b_parts, picks, strict=True)]))
        ra = _p99(np.concatenate([p[i] for p, i in zip(a_parts, picks, strict=True)]))
        ratios[k] = ra / rb if rb > 0 else math.nan
    low, high = (float(x) for x in np.nanpercentile(ratios, [2.5, 97.5]))
    out.update(
        p99_tpot_ratio=ratio,
        p99_tpot_ratio_low=low,
        p99_tpot_ratio_high=high,
        significant=not (low <= 1.0 <= high),
        note="" if not (low <= 1.0 <= high) else "not significant (the interval holds 1.0)",
    )
    return out


def comparison_rows(
    cells: Sequence[tuple[Mapping[str, Any], Sequence[Mapping[str, Any]]]],
    bootstrap: int = BOOTSTRAP,
) -> list[dict[str, Any]]:
    """One row per (regime, rate, mode) from finished cells: (row, requests) pairs."""
    groups: dict[tuple[str, float, str], list[tuple[Mapping[str, Any], Arm]]] = {}
    for row, requests in cells:
        key = (str(row["regime"]), float(row["rate"]), str(row["mode"]))
        groups.setdefault(key, []).append((row, Arm.from_cell(row, requests)))
    out = []
    for (regime, rate, mode), members in sorted(groups.items(), key=_order):
        arms = [a for _, a in members]
        base = [a for _, a in groups.get((regime, rate, BASELINE), [])]
        result = compare(base, arms, bootstrap=bootstrap) if base else {"note": "no baseline"}
        if mode == BASELINE:
            result = {**result, "p99_tpot_ratio": 1.0, "note": "baseline"}
        out.append(
            {
                "regime": regime,
                "rate": rate,
                "mode": mode,
                "timing": members[0][0].get("timing"),
                **result,
                "preemptions": sum(a.preemptions for a in arms),
                "baseline_preemptions": sum(a.preemptions for a in base),
                "migrations_completed": sum(a.migrations for a in arms),
                "decisions": sum(a.decisions for a in arms),
                "p99_ttft_ms": _mean([a.p99_ttft_ms for a in arms]),
            }
        )
    return out


def _mean(values: Sequence[float]) -> float:
    kept = [v for v in values if not math.isnan(v)]
    return sum(kept) / len(kept) if kept else math.nan


def _order(item: tuple[tuple[str, float, str], Any]) -> tuple[str, float, int, str]:
    from benchmarks.e2e.report import MODES

    regime, rate, mode = item[0]
    return regime, rate, MODES.index(mode) if mode in MODES else len(MODES), mode


def comparison_table(rows: Sequence[Mapping[str, Any]]) -> str:
    """The paired comparison as a markdown table (what ``star bench e2e`` prints first)."""
    lines = [
        "| regime | rate | mode | seeds | pairs | length match | P99 TPOT ms (pooled) "
        "| × no-mig. [95 % CI] | preemptions | migrations done / decided | note |",
        "|" + "---|" * 11,
    ]
    for r in rows:
        label = r["regime"] + (
            " (emulated device timing)" if r.get("timing") == "emulated device timing" else ""
        )
        if r["mode"] == BASELINE:
            ratio = "—"
        elif r.get("p99_tpot_ratio") is None:
            ratio = "-"
        else:
            ratio = (
                f"{r['p99_tpot_ratio']:.2f} [{r['p99_tpot_ratio_low']:.2f}, "
                f"{r['p99_tpot_ratio_high']:.2f}]"
            )
        match = r.get("length_match")
        lines.append(
            f"| {label} | {r['rate']:g} | {r['mode']} | {r.get('seeds', '-')} "
            f"| {r.get('requests', '-')} "
            f"| {'-' if match is None or math.isnan(match) else f'{match:.0%}'} "
            f"| {_f(r.get('p99_tpot_ms'))} | {ratio} | {r['preemptions']} "
            f"| {r['migrations_completed']} / {r['decisions']} | {r.get('note', '')} |"
        )
    return "\n".join(lines)


def _f(v: Any) -> str:
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:.1f}"
