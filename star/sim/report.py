"""Sweep output: CSV/JSON rows, aggregated tables and the paper's figures.

- Fig. 10 ("Execution time variance comparison across different cluster
  sizes"): mean execution-time variance per mode against cluster size.
- Variance over time for one cluster size (Fig. 8's view, simulated).
- Fig. 12 ("Runtime traces ... the maximum decode-instance KVCache usage; the
  dashed line marks the 99% threshold; shaded regions indicate when OOM
  occurs; vertical ticks denote rescheduling events"), with preemptions as
  the OOM events.
- Tables 4 and 5 (bins and prediction interval), as markdown.

matplotlib is imported only when a figure is drawn.
"""

from __future__ import annotations

import csv
import json
import math
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from star.sim.metrics import SimResult

MODE_LABELS: dict[str, str] = {
    "no-migration": "vLLM (no migration)",
    "current": "STAR w/o prediction",
    "predicted": "STAR w/ prediction",
    "oracle": "STAR Oracle",
}
MODE_STYLE: dict[str, tuple[str, str]] = {
    "no-migration": ("tab:gray", "o"),
    "current": ("tab:blue", "s"),
    "predicted": ("tab:red", "^"),
    "oracle": ("tab:green", "D"),
}

# Numeric row fields averaged over seeds.
METRICS: tuple[str, ...] = (
    "exec_time_variance",
    "p99_tpot_ms",
    "mean_tpot_ms",
    "p99_ttft_s",
    "goodput_rps",
    "throughput_rps",
    "preemptions",
    "migrations",
    "migrations_per_finished",
    "max_kv_usage",
    "wall_seconds",
    "cpu_seconds",
)


class PlotUnavailable(RuntimeError):
    """matplotlib is not installed."""


def write_csv(rows: Sequence[Mapping[str, Any]], path: Path) -> None:
    """All rows, the union of their keys as columns (first row's order first)."""
    keys: list[str] = []
    for row in rows:
        keys.extend(k for k in row if k not in keys)
    with path.open("w", newline="", encoding="utf-8") as fh:
        writer = csv.DictWriter(fh, fieldnames=keys)
        writer.writeheader()
        for row in rows:
            writer.writerow(row)


def write_json(rows: Sequence[Mapping[str, Any]], path: Path) -> None:
    """Rows as a JSON list."""
    path.write_text(json.dumps(list(rows), indent=1) + "\n", encoding="utf-8")


def aggregate(
    rows: Iterable[Mapping[str, Any]], keys: Sequence[str] = ("setting", "mode", "instances")
) -> list[dict[str, Any]]:
    """Mean (and ``*_std``) of :data:`METRICS` over seeds, per ``keys`` group."""
    groups: dict[tuple[Any, ...], list[Mapping[str, Any]]] = defaultdict(list)
    for row in rows:
        groups[tuple(row.get(k) for k in keys)].append(row)
    out: list[dict[str, Any]] = []
    for group, members in groups.items():
        agg: dict[str, Any] = dict(zip(keys, group, strict=True))
        agg["seeds"] = len(members)
        for m in METRICS:
            values = np.array([float(r[m]) for r in members if m in r])
            if values.size:
                agg[m] = float(values.mean())
                agg[m + "_std"] = float(values.std())
        out.append(agg)
    return out


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A GitHub markdown table."""

    def cell(v: Any) -> str:
        if isinstance(v, float):
            if v == 0 or (1e-3 <= abs(v) < 1e5):
                return f"{v:.3f}" if abs(v) < 10 else f"{v:.1f}"
            return f"{v:.3g}"
        return str(v)

    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def sweep_table(agg: Sequence[Mapping[str, Any]], modes: Sequence[str]) -> str:
    """Per cluster size and mode: variance, P99 TPOT, goodput, throughput, counts."""
    rows = []
    for a in sorted(agg, key=lambda a: (a["instances"], _mode_order(a["mode"], modes))):
        rows.append(
            [
                a["instances"],
                a["mode"],
                a["exec_time_variance"],
                a.get("exec_time_variance_std", 0.0),
                a["p99_tpot_ms"],
                a["goodput_rps"],
                a["throughput_rps"],
                a["preemptions"],
                a["migrations"],
                a["migrations_per_finished"],
            ]
        )
    return markdown_table(
        [
            "decode instances",
            "mode",
            "exec-time var (ms²)",
            "± std",
            "P99 TPOT (ms)",
            "goodput (req/s)",
            "throughput (req/s)",
            "preemptions",
            "migrations",
            "migrations / finished",
        ],
        rows,
    )


def study_table(agg: Sequence[Mapping[str, Any]], settings: Sequence[tuple[str, str]]) -> str:
    """Paper Table 4/5 layout: Exec. Var., P99 TPOT, Goodput, Goodput Gain vs "No pred."."""
    by_setting = {a["setting"]: a for a in agg}
    base = by_setting.get(settings[-1][0])
    rows = []
    for key, label in settings:
        a = by_setting.get(key)
        if a is None:
            continue
        gain = 0.0
        if base is not None and base["goodput_rps"] > 0:
            gain = (a["goodput_rps"] / base["goodput_rps"] - 1.0) * 100.0
        rows.append(
            [label, a["exec_time_variance"], a["p99_tpot_ms"], a["goodput_rps"], f"{gain:.2f}%"]
        )
    return markdown_table(
        ["Setting", "Exec. Var. (ms²)", "P99 TPOT (ms)", "Goodput (req/s)", "Goodput Gain"], rows
    )


def _mode_order(mode: str, modes: Sequence[str]) -> int:
    return modes.index(mode) if mode in modes else len(modes)


def _pyplot() -> Any:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise PlotUnavailable(
            "matplotlib is not installed (pip install 'star-serve[plot]')"
        ) from exc
    return plt


def plot_variance_vs_size(
    agg: Sequence[Mapping[str, Any]],
    path: Path,
    title: str = "Execution-time variance vs cluster size",
) -> None:
    """Fig. 10: mean exec-time variance (log scale) per mode against decode instances."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    modes = [m for m in MODE_LABELS if any(a["mode"] == m for a in agg)]
    modes += sorted({a["mode"] for a in agg} - set(modes))
    for mode in modes:
        pts = sorted((a for a in agg if a["mode"] == mode), key=lambda a: a["instances"])
        x = [a["instances"] for a in pts]
        y = [a["exec_time_variance"] for a in pts]
        err = [a.get("exec_time_variance_std", 0.0) for a in pts]
        color, marker = MODE_STYLE.get(mode, ("black", "x"))
        ax.errorbar(
            x,
            y,
            yerr=err,
            label=MODE_LABELS.get(mode, mode),
            color=color,
            marker=marker,
            capsize=3,
            linewidth=1.5,
        )
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    xs = sorted({a["instances"] for a in agg})
    ax.set_xticks(xs, [str(x) for x in xs])
    ax.set_xlabel("decode instances")
    ax.set_ylabel("execution-time variance (ms²)")
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=150)
    plt.close(fig)


def _smooth(y: np.ndarray[Any, Any], width: int) -> np.ndarray[Any, Any]:
    if width <= 1 or y.size < width:
        return y
    kernel = np.ones(width) / width
    out: np.ndarray[Any, Any] = np.convolve(y, kernel, mode="same")
    return out


def plot_variance_over_time(
    results: Sequence[SimResult], path: Path, smooth_s: float = 30.0
) -> None:
    """Exec-time variance over time, one line per mode (one run each)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7.0, 3.6))
    for res in results:
        mode = str(res.row["mode"])
        t = res.series["t"]
        tick = float(t[1] - t[0]) if t.size > 1 else 1.0
        y = _smooth(res.series["exec_var_ms2"], max(1, round(smooth_s / tick)))
        color, _ = MODE_STYLE.get(mode, ("black", "x"))
        ax.plot(
            t, np.maximum(y, 1e-4), label=MODE_LABELS.get(mode, mode), color=color, linewidth=1.2
        )
    n = results[0].row["instances"] if results else 0
    ax.set_yscale("log")
    ax.set_xlabel("simulated time (s)")
    ax.set_ylabel("exec-time variance (ms²)")
    ax.set_title(f"Execution-time variance over time, {n} decode instances ({smooth_s:.0f} s mean)")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=150)
    plt.close(fig)


def plot_kv_usage(results: Sequence[SimResult], path: Path) -> None:
    """Fig. 12: maximum KV usage over time per mode, migrations as ticks, preemptions shaded."""
    plt = _pyplot()
    fig, axes = plt.subplots(
        len(results), 1, figsize=(7.0, 1.6 * len(results) + 0.6), sharex=True, squeeze=False
    )
    for ax, res in zip(axes[:, 0], results, strict=True):
        mode = str(res.row["mode"])
        t = res.series["t"]
        color, _ = MODE_STYLE.get(mode, ("black", "x"))
        ax.plot(t, res.series["kv_max"] * 100.0, color=color, linewidth=1.0)
        ax.axhline(99.0, color="black", linestyle="--", linewidth=0.8)
        tick = float(t[1] - t[0]) if t.size > 1 else 1.0
        for p in np.unique(np.floor(res.preemption_times / tick) * tick):
            ax.axvspan(p, p + tick, color="tab:orange", alpha=0.4, linewidth=0)
        if res.migration_times.size:
            ax.plot(
                res.migration_times,
                np.full(res.migration_times.size, 3.0),
                "|",
                color="black",
                markersize=6,
                alpha=0.5,
            )
        ax.set_ylim(0, 105)
        ax.set_ylabel("max KV %")
        ax.set_title(
            f"{MODE_LABELS.get(mode, mode)}: {res.row['preemptions']} preemptions, "
            f"{res.row['migrations']} migrations",
            fontsize=9,
        )
        ax.grid(True, alpha=0.3)
    axes[-1, 0].set_xlabel("simulated time (s)")
    fig.tight_layout()
    fig.savefig(path, dpi=150)
    plt.close(fig)


def finite(value: float) -> float:
    """``value`` or 0.0 when it is not finite (for JSON)."""
    return value if math.isfinite(value) else 0.0
