"""What one simulated run reports (paper §6.2-6.4).

- Execution-time variance across decode instances (§6.3, Fig. 10; the
  "Exec. Var." of Tables 4 and 5): at every scheduler tick, the variance over
  decode instances of the time one decode iteration takes there now,
  a + b x (tokens in its running batch), in ms^2; reported as a time series
  and its mean over [warmup, duration]. An idle instance counts with
  L = 0 (its next iteration would take a).
- P99 TPOT over finished requests, TPOT = (finish - first token) /
  (output tokens - 1): migration stalls, preemption and recompute included.
- TTFT = prefill completion - arrival (the prefill engine emits the first
  token; queueing at the prefill instance included).
- Goodput (§6.2): finished requests per second meeting both SLOs (TTFT 1 s,
  TPOT 25 ms by default); throughput: finished requests per second.
- Preemptions (vLLM-like recompute when KV capacity is exceeded) and
  migrations, counted; KV usage (tokens held / capacity, running batches plus
  KV held for migrations) per instance, its maximum over instances per tick
  (Fig. 12's curve) and overall.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]

# The keys `star simulate --json` prints, in order.
ROW_KEYS: tuple[str, ...] = (
    "mode",
    "instances",
    "seed",
    "exec_time_variance",
    "p99_tpot_ms",
    "goodput_rps",
    "throughput_rps",
    "preemptions",
    "migrations",
    "migrations_per_finished",
    "sim_seconds",
    "wall_seconds",
)


@dataclass
class Series:
    """Per-tick samples, appended by the engine."""

    t: list[float] = field(default_factory=list)
    exec_var_ms2: list[float] = field(default_factory=list)
    kv_max: list[float] = field(default_factory=list)
    kv_mean: list[float] = field(default_factory=list)
    running: list[int] = field(default_factory=list)
    waiting: list[int] = field(default_factory=list)

    def arrays(self) -> dict[str, FloatArray]:
        """The samples as float arrays, keyed by name."""
        return {
            name: np.asarray(getattr(self, name), dtype=np.float64)
            for name in ("t", "exec_var_ms2", "kv_max", "kv_mean", "running", "waiting")
        }


@dataclass(frozen=True)
class RequestLog:
    """Per-request outcome arrays (NaN where a time was not reached)."""

    arrival: FloatArray
    prompt: IntArray
    output: IntArray
    ttft_s: FloatArray
    finish: FloatArray
    preemptions: IntArray
    migrations: IntArray
    generated: IntArray

    def tpot_s(self) -> FloatArray:
        """(finish - first token) / (output - 1) for finished requests with >= 2 tokens."""
        decode = self.output - 1
        with np.errstate(invalid="ignore", divide="ignore"):
            out: FloatArray = np.where(
                decode > 0, (self.finish - (self.arrival + self.ttft_s)) / decode, np.nan
            )
        return out


@dataclass(frozen=True)
class SimResult:
    """One run: the summary row, per-tick series, events and per-request log."""

    row: dict[str, Any]
    series: dict[str, FloatArray]
    migration_times: FloatArray
    preemption_times: FloatArray
    requests: RequestLog

    def json_row(self) -> dict[str, Any]:
        """The row restricted to :data:`ROW_KEYS` (``star simulate --json``)."""
        return {k: self.row[k] for k in ROW_KEYS}


def summarise(
    requests: RequestLog,
    series: dict[str, FloatArray],
    *,
    duration_s: float,
    warmup_s: float,
    ttft_slo_s: float,
    tpot_slo_s: float,
) -> dict[str, Any]:
    """The metrics of one run from its request log and series."""
    done = np.isfinite(requests.finish) & (requests.finish <= duration_s)
    counted = done & (requests.arrival >= warmup_s)
    window = duration_s - warmup_s
    tpot = requests.tpot_s()[counted]
    ttft = requests.ttft_s[counted]
    tpot_ok = np.where(np.isnan(tpot), True, tpot <= tpot_slo_s)
    good = int(np.count_nonzero(tpot_ok & (ttft <= ttft_slo_s)))
    finite_tpot = tpot[np.isfinite(tpot)]
    t = series["t"]
    in_window = t >= warmup_s
    var = series["exec_var_ms2"][in_window]
    kv = series["kv_max"][in_window]
    return {
        "exec_time_variance": float(var.mean()) if var.size else 0.0,
        "p99_tpot_ms": float(np.percentile(finite_tpot, 99) * 1e3) if finite_tpot.size else 0.0,
        "mean_tpot_ms": float(finite_tpot.mean() * 1e3) if finite_tpot.size else 0.0,
        "p50_ttft_s": float(np.percentile(ttft, 50)) if ttft.size else 0.0,
        "p99_ttft_s": float(np.percentile(ttft, 99)) if ttft.size else 0.0,
        "goodput_rps": good / window,
        "throughput_rps": int(np.count_nonzero(counted)) / window,
        "finished": int(np.count_nonzero(done)),
        "max_kv_usage": float(kv.max()) if kv.size else 0.0,
        "mean_max_kv_usage": float(kv.mean()) if kv.size else 0.0,
    }


def percentile(values: npt.ArrayLike, q: float) -> float:
    """``np.percentile`` that answers 0.0 for an empty input."""
    x = np.asarray(values, dtype=np.float64)
    return float(np.percentile(x, q)) if x.size else 0.0
