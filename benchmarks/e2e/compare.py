"""Each mode against ``no-migration``, paired request by request and pooled over seeds (pure).

Every mode of a seed serves the same requests (same prompts, send times and,
with greedy decoding, the same output lengths: :mod:`benchmarks.e2e.workload`),
so request ``i`` of seed ``s`` is one pair. Only the **steady-state window**
counts: requests sent in the first or last :data:`WINDOW_EDGE` of a cell's
send span (the fleet filling from empty, and draining once arrivals stop)
are left out, and counted (``ramp_excluded``, ``drain_excluded``). Per
(regime, cluster, rate, mode), each fleet shape apart:

- ``length_match``: the share of pairs whose output lengths are equal. Below
  :data:`LENGTH_MATCH_MIN` the arms did not serve the same work and no ratio
  is reported (``note`` says why).
- ``p99_tpot_ms`` of each arm over the pairs of every seed pooled (with 5
  seeds of 1,000 requests, P99 rests on 50 requests, not one), and
  ``p99_tpot_ratio`` mode / baseline with a 95 % bootstrap interval: pairs
  resampled within each seed (the same pairs for both arms), B =
  :data:`BOOTSTRAP` times. ``significant`` is False whenever the interval
  holds 1.0.
- ``p99_ttft_ratio`` likewise for TTFT, over every pair both arms completed
  (``pooled_p99_ttft_ms``, ``baseline_p99_ttft_ms``; ``p99_ttft_ms`` is the
  mean of the cells' own P99s).
- ``preemptions`` and ``migrations_completed`` summed over seeds (vLLM's
  counter; RESUMED moves, refused decisions apart in ``decisions``);
  ``baseline_preemptions`` over the seeds the mode ran, so a mode with fewer
  seeds is set against the same seeds of the baseline.
- ``capacity_goodput_rps`` and its ratio (per regime and mode, over the rates
  swept): the highest rate at which at least :data:`ATTAINMENT` of the
  window's requests meet the SLO, by :func:`capacity` (documented there).
"""

from __future__ import annotations

import itertools
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
WINDOW_EDGE = 0.1  # share of the send span left out at each end
ATTAINMENT = 0.9  # capacity goodput: the share of requests that must meet the SLO


@dataclass(frozen=True, slots=True)
class Arm:
    """One cell's requests by schedule index (ms; NaN TPOT when under 2 tokens)."""

    seed: int
    sent_s: Mapping[int, float]  # every request, served or not
    lengths: Mapping[int, int]  # completed requests only
    tpot_ms: Mapping[int, float]
    ttft_ms: Mapping[int, float]  # completed requests only
    met: Mapping[int, bool]  # every request: completed within both SLOs
    preemptions: int
    migrations: int
    decisions: int
    p99_ttft_ms: float
    inside: tuple[int, ...] = ()  # indices sent in the steady-state window, in order
    ramp: int = 0  # requests left out at the start of the window
    drain: int = 0  # and at its end

    @classmethod
    def from_cell(
        cls,
        row: Mapping[str, Any],
        requests: Sequence[Mapping[str, Any]],
        slo_ms: tuple[float, float] = (math.inf, math.inf),
    ) -> Arm:
        """From a cell's row, its ``requests.csv`` rows (strings as written, or values)
        and its SLO (TTFT, TPOT in ms)."""
        sent: dict[int, float] = {}
        lengths: dict[int, int] = {}
        tpot: dict[int, float] = {}
        ttfts: dict[int, float] = {}
        met: dict[int, bool] = {}
        for r in requests:
            i = int(r["index"])
            sent[i] = float(r.get("sent_s") or 0.0)
            met[i] = False
            if str(r["ok"]) != "True":
                continue
            lengths[i] = int(r["output_tokens"])
            raw = r.get("tpot_s")
            tpot[i] = float(raw) * 1e3 if raw not in (None, "") else math.nan
            ttft = ttfts[i] = float(r.get("ttft_s") or 0.0) * 1e3
            met[i] = ttft <= slo_ms[0] and (math.isnan(tpot[i]) or tpot[i] <= slo_ms[1])
        inside, ramp, drain = _window(sent)
        return cls(
            seed=int(row["seed"]),
            sent_s=sent,
            lengths=lengths,
            tpot_ms=tpot,
            ttft_ms=ttfts,
            met=met,
            preemptions=int(row.get("preemptions") or 0),
            migrations=_completed(row),
            decisions=int(row.get("decisions", row.get("migrations")) or 0),
            p99_ttft_ms=float(row.get("p99_ttft_ms") or math.nan),
            inside=inside,
            ramp=ramp,
            drain=drain,
        )


def _window(sent: Mapping[int, float]) -> tuple[tuple[int, ...], int, int]:
    """(Indices sent in the steady-state window, left out at the start, at the end)."""
    if not sent:
        return (), 0, 0
    first, last = min(sent.values()), max(sent.values())
    lo = first + WINDOW_EDGE * (last - first)
    hi = last - WINDOW_EDGE * (last - first)
    inside = tuple(sorted(i for i, t in sent.items() if lo <= t <= hi))
    ramp = sum(t < lo for t in sent.values())
    return inside, ramp, len(sent) - len(inside) - ramp


def _completed(row: Mapping[str, Any]) -> int:
    outcomes = row.get("migration_outcomes") or {}
    return int(outcomes.get("resumed", 0))


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
    b_first: list[npt.NDArray[np.float64]] = []  # TTFT, every pair both arms completed
    a_first: list[npt.NDArray[np.float64]] = []
    compared = same = ramp = drain = 0
    for s in seeds:
        b, a = by_seed[s], next(x for x in arm if x.seed == s)
        ramp, drain = ramp + b.ramp, drain + b.drain
        both = sorted(set(b.lengths) & set(a.lengths) & set(b.inside))
        compared += len(both)
        same += sum(b.lengths[i] == a.lengths[i] for i in both)
        paired = [i for i in both if not (math.isnan(b.tpot_ms[i]) or math.isnan(a.tpot_ms[i]))]
        b_parts.append(np.array([b.tpot_ms[i] for i in paired], dtype=float))
        a_parts.append(np.array([a.tpot_ms[i] for i in paired], dtype=float))
        b_first.append(np.array([b.ttft_ms[i] for i in both], dtype=float))
        a_first.append(np.array([a.ttft_ms[i] for i in both], dtype=float))
    match = same / compared if compared else math.nan
    b_all = np.concatenate(b_parts) if b_parts else np.empty(0)
    a_all = np.concatenate(a_parts) if a_parts else np.empty(0)
    base_p99, arm_p99 = _p99(b_all), _p99(a_all)
    out: dict[str, Any] = {
        "seeds": len(seeds),
        "requests": int(b_all.size),
        "ramp_excluded": ramp,
        "drain_excluded": drain,
        "length_match": match,
        "p99_tpot_ms": arm_p99,
        "baseline_p99_tpot_ms": base_p99,
        "p99_tpot_ratio": None,
        "p99_tpot_ratio_low": None,
        "p99_tpot_ratio_high": None,
        "p99_ttft_ratio": None,
        "p99_ttft_ratio_low": None,
        "p99_ttft_ratio_high": None,
        "significant": None,
        "note": "",
    }
    if b_first:
        out["pooled_p99_ttft_ms"] = _p99(np.concatenate(a_first))
        out["baseline_p99_ttft_ms"] = _p99(np.concatenate(b_first))
    if not seeds or not b_all.size:
        out["note"] = "no paired requests"
        return out
    if not match >= LENGTH_MATCH_MIN:
        out["note"] = (
            f"not compared: only {match:.0%} of the requests have the baseline's output length "
            f"(at least {LENGTH_MATCH_MIN:.0%} needed): the arms did not serve the same work"
        )
        return out
    rng = np.random.default_rng(seed)
    ratio, low, high = paired_p99_ratio(b_parts, a_parts, rng, bootstrap)
    holds_one = low <= 1.0 <= high
    out.update(
        p99_tpot_ratio=ratio,
        p99_tpot_ratio_low=low,
        p99_tpot_ratio_high=high,
        significant=not holds_one,
        note="not significant (the interval holds 1.0)" if holds_one else "",
    )
    first = paired_p99_ratio(b_first, a_first, rng, bootstrap)
    out.update(p99_ttft_ratio=first[0], p99_ttft_ratio_low=first[1], p99_ttft_ratio_high=first[2])
    return out


def paired_p99_ratio(
    base: Sequence[npt.NDArray[np.float64]],
    arm: Sequence[npt.NDArray[np.float64]],
    rng: np.random.Generator,
    bootstrap: int,
) -> tuple[float, float, float]:
    """P99 of ``arm`` / P99 of ``base``, each pooled over seeds (one array per seed, paired
    index by index), with a 95 % bootstrap interval: pairs resampled within each seed, the
    same picks for both arms."""
    b_p99 = _p99(np.concatenate(base))
    ratio = _p99(np.concatenate(arm)) / b_p99 if b_p99 > 0 else math.nan
    ratios = np.empty(bootstrap)
    for k in range(bootstrap):
        picks = [rng.integers(0, p.size, p.size) for p in base]
        rb = _p99(np.concatenate([p[i] for p, i in zip(base, picks, strict=True)]))
        ra = _p99(np.concatenate([p[i] for p, i in zip(arm, picks, strict=True)]))
        ratios[k] = ra / rb if rb > 0 else math.nan
    low, high = (float(x) for x in np.nanpercentile(ratios, [2.5, 97.5]))
    return ratio, low, high


def capacity(points: Sequence[tuple[float, float]]) -> tuple[float | None, str]:
    """The capacity goodput (req/s) from (rate, attainment) points of a rate sweep, and how found.

    The rule, fixed before any run: walk the swept rates upwards while the
    share of requests meeting the SLO is at least :data:`ATTAINMENT`; the
    capacity is where the line between the last rate that holds and the
    first that does not crosses :data:`ATTAINMENT` ("interpolated"). When
    every rate holds, it is the highest rate swept (">=", a lower bound);
    when the lowest does not, there is none (None, "below the sweep").
    """
    pts = sorted(points)
    if not pts:
        return None, "no rates"
    if pts[0][1] < ATTAINMENT:
        return None, "below the sweep"
    for (r0, a0), (r1, a1) in itertools.pairwise(pts):
        if a1 < ATTAINMENT:
            return r0 + (r1 - r0) * (a0 - ATTAINMENT) / (a0 - a1), "interpolated"
    return pts[-1][0], ">="


def _attainment(arms: Sequence[Arm], picks: Mapping[int, npt.NDArray[np.int64]] | None) -> float:
    """Share of the window's requests that met the SLO, pooled over seeds (``picks``: resampled)."""
    met = total = 0
    for a in arms:
        inside: Sequence[int] = a.inside
        if picks is not None:
            inside = [a.inside[j] for j in picks[a.seed]]
        met += sum(a.met[i] for i in inside)
        total += len(inside)
    return met / total if total else math.nan


def capacity_rows(
    sweeps: Mapping[str, Mapping[float, Sequence[Arm]]], seed: int = 0, bootstrap: int = 500
) -> dict[str, dict[str, Any]]:
    """Per mode of one regime and cluster (``sweeps[mode][rate]``: its arms): capacity goodput, and for
    every mode but the baseline its ratio with a bootstrap interval (pairs resampled within
    each rate and seed, the same for both arms)."""
    out: dict[str, dict[str, Any]] = {}
    base = sweeps.get(BASELINE, {})
    rng = np.random.default_rng(seed)
    for mode, by_rate in sweeps.items():
        cap, how = capacity([(r, _attainment(arms, None)) for r, arms in by_rate.items()])
        row: dict[str, Any] = {"capacity_goodput_rps": cap, "capacity_found": how}
        rates = sorted(set(by_rate) & set(base))
        if mode != BASELINE and rates:
            base_cap, base_how = capacity([(r, _attainment(base[r], None)) for r in rates])
            mine, my_how = capacity([(r, _attainment(by_rate[r], None)) for r in rates])
            if not (base_how == my_how == "interpolated"):
                # A bound is no point: the sweep must cross the target in both arms.
                row["capacity_goodput_ratio"] = None
                row["capacity_note"] = "no ratio: the sweep does not find both capacities"
                out[mode] = row
                continue
            ratio = mine / base_cap if mine is not None and base_cap else None
            draws = []
            for _ in range(bootstrap):
                picks = {
                    r: {a.seed: rng.integers(0, n, n) for a in base[r] if (n := len(a.inside))}
                    for r in rates
                }
                b_cap, _ = capacity([(r, _attainment(base[r], picks[r])) for r in rates])
                m_cap, _ = capacity(
                    [
                        (r, _attainment([a for a in by_rate[r] if a.seed in picks[r]], picks[r]))
                        for r in rates
                    ]
                )
                if b_cap and m_cap is not None:
                    draws.append(m_cap / b_cap)
            low, high = (
                (float(x) for x in np.percentile(draws, [2.5, 97.5])) if draws else (None, None)
            )
            row |= {
                "capacity_goodput_ratio": ratio,
                "capacity_goodput_ratio_low": low,
                "capacity_goodput_ratio_high": high,
            }
        out[mode] = row
    return out


def comparison_rows(
    cells: Sequence[tuple[Mapping[str, Any], Sequence[Mapping[str, Any]]]],
    bootstrap: int = BOOTSTRAP,
) -> list[dict[str, Any]]:
    """One row per (regime, cluster, rate, mode) from finished cells: (``cell.json``
    document, requests). Fleet shapes are compared apart: a cell is paired only
    with the baseline of its own regime, cluster, rate and seed."""
    from benchmarks.e2e.report import group_of

    groups: dict[tuple[str, str, float, str], list[tuple[Mapping[str, Any], Arm]]] = {}
    for doc, requests in cells:
        row = doc["row"]
        reg = (doc.get("config") or {}).get("regime") or {}
        slo = (float(reg.get("slo_ttft_ms", math.inf)), float(reg.get("slo_tpot_ms", math.inf)))
        groups.setdefault(group_of(doc), []).append((row, Arm.from_cell(row, requests, slo)))
    sweeps: dict[tuple[str, str], dict[str, dict[float, list[Arm]]]] = {}
    for (regime, cluster, rate, mode), members in groups.items():
        sweep = sweeps.setdefault((regime, cluster), {})
        sweep.setdefault(mode, {})[rate] = [a for _, a in members]
    capacities = {shape: capacity_rows(by_mode) for shape, by_mode in sweeps.items()}
    out = []
    for (regime, cluster, rate, mode), members in sorted(groups.items(), key=_order):
        arms = [a for _, a in members]
        base = [a for _, a in groups.get((regime, cluster, rate, BASELINE), [])]
        result = compare(base, arms, bootstrap=bootstrap) if base else {"note": "no baseline"}
        if mode == BASELINE:
            result = {**result, "p99_tpot_ratio": 1.0, "note": "baseline"}
        cap = dict(capacities[regime, cluster].get(mode, {}))
        if result.get("p99_tpot_ratio") is None and mode != BASELINE:
            cap["capacity_goodput_ratio"] = None  # unpaired: no ratio of any kind
        out.append(
            {
                "regime": regime,
                "cluster": cluster,
                "rate": rate,
                "mode": mode,
                "timing": members[0][0].get("timing"),
                **result,
                "preemptions": sum(a.preemptions for a in arms),
                # the baseline over the seeds this mode ran: a mode with fewer seeds
                # would otherwise read low against the baseline's every seed
                "baseline_preemptions": sum(
                    b.preemptions for b in base if b.seed in {a.seed for a in arms}
                ),
                "migrations_completed": sum(a.migrations for a in arms),
                "decisions": sum(a.decisions for a in arms),
                "p99_ttft_ms": _mean([a.p99_ttft_ms for a in arms]),
                "slo_attainment": _attainment(arms, None),
                **cap,
            }
        )
    return out


def _mean(values: Sequence[float]) -> float:
    kept = [v for v in values if not math.isnan(v)]
    return sum(kept) / len(kept) if kept else math.nan


def _order(item: tuple[tuple[str, str, float, str], Any]) -> tuple[str, str, float, int, str]:
    from benchmarks.e2e.report import MODES

    regime, cluster, rate, mode = item[0]
    return regime, cluster, rate, MODES.index(mode) if mode in MODES else len(MODES), mode


def comparison_table(rows_in: Sequence[Mapping[str, Any]]) -> str:
    """The paired comparison as a markdown table (what ``star bench e2e`` prints first)."""
    from benchmarks.e2e.report import markdown

    head = (
        "regime",
        "cluster",
        "rate",
        "mode",
        "seeds",
        "pairs",
        "length match",
        "P99 TPOT ms (pooled)",
        "× no-mig. [95 % CI]",
        "predicted P99 ms",
        "P99 TTFT × no-mig. [95 % CI]",
        "SLO met",
        "capacity req/s",
        "× no-mig. [95 % CI]",
        "preemptions (no-mig., same seeds)",
        "migrations done / decided",
        "note",
    )
    rows = []
    for r in rows_in:
        label = r["regime"] + (
            " (emulated device timing)" if r.get("timing") == "emulated device timing" else ""
        )
        match = r.get("length_match")
        rows.append(
            (
                label,
                r.get("cluster", "-"),
                f"{r['rate']:g}",
                r["mode"],
                r.get("seeds", "-"),
                r.get("requests", "-"),
                "-" if match is None or math.isnan(match) else f"{match:.0%}",
                _f(r.get("p99_tpot_ms")),
                _ratio(r, "p99_tpot_ratio"),
                _f(r.get("predicted_p99_tpot_ms")),
                _ratio(r, "p99_ttft_ratio"),
                _pct(r.get("slo_attainment")),
                _capacity(r),
                _ratio(r, "capacity_goodput_ratio"),
                _preemptions(r),
                f"{r['migrations_completed']} / {r['decisions']}",
                r.get("note", ""),
            )
        )
    return markdown(head, rows)


def _preemptions(r: Mapping[str, Any]) -> str:
    if r["mode"] == BASELINE or r.get("baseline_preemptions") is None:
        return str(r["preemptions"])
    return f"{r['preemptions']} ({r['baseline_preemptions']})"


def _ratio(r: Mapping[str, Any], key: str) -> str:
    if r["mode"] == BASELINE:
        return "—"
    if r.get(key) is None:
        return "-"
    low, high = r.get(key + "_low"), r.get(key + "_high")
    if low is None or high is None:
        return f"{r[key]:.2f}"
    # Rounded, an interval that holds 1.0 may read [1.00, 1.02]: say so.
    verdict = " n.s." if low <= 1.0 <= high else ""
    return f"{r[key]:.2f} [{low:.2f}, {high:.2f}]{verdict}"


def _capacity(r: Mapping[str, Any]) -> str:
    cap, how = r.get("capacity_goodput_rps"), r.get("capacity_found", "")
    if cap is None:
        return how or "-"
    return f"≥ {cap:g}" if how == ">=" else f"{cap:.2f}"


def _pct(v: Any) -> str:
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:.0%}"


def _f(v: Any) -> str:
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:.1f}"
