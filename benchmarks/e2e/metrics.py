"""What one end-to-end cell measured, computed from its records (pure, table-tested).

Inputs are what the harness recorded: per request the client's timing
(:class:`RequestRecord`), and the bus as it was during the run -- every
decode instance's reports (KV use, running and waiting requests, step time,
vLLM's own cumulative preemption counter, the padding share under emulated
device timing), every decision and every lifecycle event.

Definitions (paper §6.1-6.3):

- goodput: completed requests per second with TTFT <= the TTFT SLO and
  TPOT <= the TPOT SLO at the cell's offered rate (the paper's §6 per-run
  rate; it cannot exceed the offered rate, so where the baseline meets the
  SLO the ratio's ceiling is near 1. DistServe's goodput is another number:
  the highest rate that sustains an attainment target, found by a sweep);
- migrations: completed moves (RESUMED events); ``decisions`` counts every
  decision, refused and expired ones included;
- preemptions: the increase of vLLM's counter on each decode instance over
  the run, summed (the counter is cumulative since the engine started);
- execution-time variance (Fig. 10): in each 1 s bin, the variance across
  decode instances of their decode step time (0 for an instance with nothing
  running), in ms^2; the cell's figure is the mean over bins;
- max KV use (Fig. 11): the fullest decode instance's used / capacity tokens.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from benchmarks.serve import Slo
from star.wire import Decision, Event, EventKind, Report

BIN_S = 1.0  # time series resolution (s)


@dataclass(frozen=True, slots=True)
class RequestRecord:
    """One client request as the client saw it (seconds; TPOT None below 2 tokens)."""

    index: int
    request_id: str
    sent_s: float  # from the run's start
    ok: bool
    max_tokens: int
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft_s: float = 0.0
    e2e_s: float = 0.0
    tpot_s: float | None = None
    error: str = ""
    migrations: int = 0


def met(slo: Slo, r: RequestRecord) -> bool:
    """Whether a request counts toward goodput: completed, TTFT and TPOT within ``slo``."""
    return (
        r.ok
        and r.ttft_s * 1e3 <= slo.ttft_ms
        and (r.tpot_s is None or r.tpot_s * 1e3 <= slo.tpot_ms)
    )


@dataclass(slots=True)
class InstanceSeries:
    """One decode instance over time (from its reports), times in s from the run's start."""

    t: list[float] = field(default_factory=list)
    kv_used: list[int] = field(default_factory=list)
    capacity: list[int] = field(default_factory=list)
    running: list[int] = field(default_factory=list)
    waiting: list[int] = field(default_factory=list)
    step_ms: list[float] = field(default_factory=list)
    preemptions: list[int] = field(default_factory=list)  # cumulative (vLLM's counter)
    pad_share: list[float] = field(default_factory=list)


def instance_series(reports: Iterable[Report], t0: float) -> dict[str, InstanceSeries]:
    """Decode instances' reports as series, in report order."""
    out: dict[str, InstanceSeries] = {}
    for r in sorted(reports, key=lambda r: (r.instance, r.seq)):
        if r.role != "decode":
            continue
        s = out.setdefault(r.instance, InstanceSeries())
        s.t.append(r.ts - t0)
        s.kv_used.append(r.used_tokens)
        s.capacity.append(r.capacity_tokens)
        s.running.append(len(r.requests))
        s.waiting.append(r.waiting)
        s.step_ms.append(r.step_time_s * 1e3 if r.requests else 0.0)
        s.preemptions.append(r.preemptions)
        s.pad_share.append(r.pad_share)
    return out


def _binned(series: dict[str, InstanceSeries], attr: str, end_s: float) -> np.ndarray:
    """(instances x bins) of each instance's last value of ``attr`` in each bin, carried forward."""
    nbins = max(math.ceil(end_s / BIN_S), 1)
    out = np.zeros((len(series), nbins))
    for row, s in enumerate(series.values()):
        values = getattr(s, attr)
        j = 0
        last = 0.0
        for b in range(nbins):
            edge = (b + 1) * BIN_S
            while j < len(s.t) and s.t[j] < edge:
                last = float(values[j])
                j += 1
            out[row, b] = last
    return out


def variance_over_time(series: dict[str, InstanceSeries], end_s: float) -> list[float]:
    """Per 1 s bin, the variance of decode step time across instances (ms^2; Fig. 10)."""
    if not series:
        return []
    return [float(v) for v in _binned(series, "step_ms", end_s).var(axis=0)]


def max_kv_over_time(series: dict[str, InstanceSeries], end_s: float) -> list[float]:
    """Per 1 s bin, the fullest decode instance's KV use as a fraction (Fig. 11)."""
    if not series:
        return []
    used = _binned(series, "kv_used", end_s)
    cap = np.maximum(_binned(series, "capacity", end_s), 1)
    return [float(v) for v in (used / cap).max(axis=0)]


def fleet_kv_over_time(series: dict[str, InstanceSeries], end_s: float) -> list[float]:
    """Per 1 s bin, the decode fleet's KV use as a whole (all used / all capacity).

    Near 1 the fleet itself is full and no placement avoids preemption; an
    instance at 1 while this is well below is imbalance, what rescheduling fixes.
    """
    if not series:
        return []
    used = _binned(series, "kv_used", end_s).sum(axis=0)
    cap = np.maximum(_binned(series, "capacity", end_s).sum(axis=0), 1)
    return [float(v) for v in used / cap]


def preemption_bins(series: dict[str, InstanceSeries], end_s: float) -> list[int]:
    """Per 1 s bin, preemptions that happened in it (all decode instances; Fig. 11's shading)."""
    if not series:
        return []
    cum = _binned(series, "preemptions", end_s)
    first = np.array([s.preemptions[0] if s.preemptions else 0 for s in series.values()])
    cum = np.maximum(cum, first[:, None])
    per_bin = np.diff(np.concatenate([first[:, None], cum], axis=1), axis=1).sum(axis=0)
    return [int(v) for v in per_bin]


def preemptions(series: dict[str, InstanceSeries]) -> int:
    """Preemptions during the run: each instance's counter, last minus first report."""
    return sum(s.preemptions[-1] - s.preemptions[0] for s in series.values() if s.preemptions)


def migrations_per_request(events: Iterable[Event]) -> dict[str, int]:
    """Completed migrations (RESUMED events) per request id."""
    out: dict[str, int] = {}
    for e in events:
        if e.event is EventKind.RESUMED and e.request:
            out[e.request] = out.get(e.request, 0) + 1
    return out


def _pct(values: Sequence[float], q: float) -> float:
    return float(np.percentile(values, q)) if len(values) else math.nan


def summarize(
    records: Sequence[RequestRecord],
    series: dict[str, InstanceSeries],
    decisions: Sequence[Decision],
    events: Sequence[Event],
    duration_s: float,
    slo: Slo,
) -> dict[str, Any]:
    """The cell's row: the numbers ``star bench e2e`` tables, plots and prints as JSON."""
    ok = [r for r in records if r.ok]
    tpots = [r.tpot_s * 1e3 for r in ok if r.tpot_s is not None]
    ttfts = [r.ttft_s * 1e3 for r in ok]
    good = [r for r in records if met(slo, r)]
    dur = max(duration_s, 1e-9)
    outcomes: dict[str, int] = {}
    for e in events:
        if e.event in (EventKind.RESUMED, EventKind.ABORTED, EventKind.REFUSED, EventKind.EXPIRED):
            outcomes[e.event.value] = outcomes.get(e.event.value, 0) + 1
    variance = variance_over_time(series, duration_s)
    max_kv = max_kv_over_time(series, duration_s)
    fleet_kv = fleet_kv_over_time(series, duration_s)
    pads = [p for s in series.values() for p, n in zip(s.pad_share, s.running, strict=True) if n]
    return {
        "requests": len(records),
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "duration_s": duration_s,
        "throughput": len(ok) / dur,
        "token_throughput": sum(r.output_tokens for r in ok) / dur,
        "goodput": len(good) / dur,
        "slo_met": len(good) / max(len(records), 1),
        "p50_tpot_ms": _pct(tpots, 50),
        "p99_tpot_ms": _pct(tpots, 99),
        "mean_tpot_ms": float(np.mean(tpots)) if tpots else math.nan,
        "p50_ttft_ms": _pct(ttfts, 50),
        "p99_ttft_ms": _pct(ttfts, 99),
        "preemptions": preemptions(series),
        "migrations": outcomes.get(EventKind.RESUMED.value, 0),  # completed moves
        "decisions": len(decisions),  # every decision, refused and expired ones too
        "migration_outcomes": outcomes,
        "exec_time_variance": float(np.mean(variance)) if variance else math.nan,
        "max_kv_use": max(max_kv) if max_kv else math.nan,
        "fleet_kv_peak": max(fleet_kv) if fleet_kv else math.nan,
        "kv_capacity": min((min(s.capacity) for s in series.values() if s.capacity), default=0),
        "pad_share": float(np.mean(pads)) if pads else 0.0,
        "errors": sorted({r.error for r in records if not r.ok})[:5],
    }


def interval(values: Sequence[float], confidence: float = 0.95) -> tuple[float, float, float]:
    """(mean, low, high): Student's t interval of the mean over seeds (a point for one value)."""
    arr = np.asarray([v for v in values if not math.isnan(v)], dtype=float)
    if arr.size == 0:
        return math.nan, math.nan, math.nan
    mean = float(arr.mean())
    if arr.size < 2:
        return mean, mean, mean
    from scipy.stats import t

    half = float(t.ppf(0.5 + confidence / 2, arr.size - 1) * arr.std(ddof=1) / math.sqrt(arr.size))
    return mean, mean - half, mean + half


def records_as_rows(records: Sequence[RequestRecord]) -> list[dict[str, Any]]:
    return [asdict(r) for r in records]
