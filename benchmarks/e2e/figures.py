"""The paper's end-to-end figures from ``star bench e2e``'s results (matplotlib).

- Fig. 9: goodput, throughput and P99 TPOT against the request rate, a line
  per mode (mean over seeds, 95 % interval as error bars), one row per regime;
- Fig. 10: execution-time variance across decode instances over time, a line
  per mode (the first seed at the middle rate of each regime);
- Fig. 11: the maximum decode-instance KV use over time with the 99 % line,
  seconds with preemptions shaded, a tick per migration decision, a panel
  per mode (same cell as Fig. 10).

Panels of the device regime say "emulated device timing" in their titles.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.e2e.report import MODES, aggregate, row

COLORS = {
    "no-migration": "#7f7f7f",
    "current": "#1f77b4",
    "predicted": "#d62728",
    "oracle": "#2ca02c",
}


def _title(regime: str, docs: Sequence[dict[str, Any]]) -> str:
    timing = next((d["row"].get("timing") for d in docs if d["row"]["regime"] == regime), "")
    return f"{regime} regime ({timing})" if timing else f"{regime} regime"


def fig9(docs: Sequence[dict[str, Any]], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    aggs = aggregate([row(d) for d in docs])
    regimes = sorted({a["regime"] for a in aggs})
    metrics = (
        ("goodput", "goodput (req/s)"),
        ("throughput", "throughput (req/s)"),
        ("p99_tpot_ms", "P99 TPOT (ms)"),
    )
    fig, axes = plt.subplots(len(regimes), 3, figsize=(13, 3.6 * len(regimes)), squeeze=False)
    for i, reg in enumerate(regimes):
        for j, (key, label) in enumerate(metrics):
            ax = axes[i][j]
            for mode in MODES:
                pts = sorted(
                    (a for a in aggs if a["regime"] == reg and a["mode"] == mode),
                    key=lambda a: a["rate"],
                )
                if not pts:
                    continue
                xs = [a["rate"] for a in pts]
                ys = [a[key] for a in pts]
                err = [
                    [max(y - a[key + "_ci"][0], 0) for y, a in zip(ys, pts, strict=True)],
                    [max(a[key + "_ci"][1] - y, 0) for y, a in zip(ys, pts, strict=True)],
                ]
                ax.errorbar(xs, ys, yerr=err, marker="o", capsize=3, label=mode, color=COLORS[mode])
            ax.set_xlabel("request rate (req/s)")
            ax.set_ylabel(label)
            ax.grid(alpha=0.3)
            if j == 0:
                ax.set_title(_title(reg, docs), loc="left", fontsize=10)
        axes[i][0].legend(fontsize=8)
    fig.suptitle("STAR end to end: 1 prefill + 3 decode vLLM engines (paper Fig. 9)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _showcase(docs: Sequence[dict[str, Any]], regime: str) -> list[dict[str, Any]]:
    """One cell per mode: the first seed at the middle rate run in ``regime``."""
    mine = [d for d in docs if d["row"]["regime"] == regime]
    rates = sorted({float(d["row"]["rate"]) for d in mine})
    if not rates:
        return []
    rate = rates[len(rates) // 2]
    out = []
    for mode in MODES:
        cells = sorted(
            (d for d in mine if d["row"]["mode"] == mode and float(d["row"]["rate"]) == rate),
            key=lambda d: d["row"]["seed"],
        )
        if cells:
            out.append(cells[0])
    return out


def fig10(docs: Sequence[dict[str, Any]], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    regimes = sorted({d["row"]["regime"] for d in docs})
    fig, axes = plt.subplots(
        1, len(regimes), figsize=(max(6.5 * len(regimes), 9.0), 3.8), squeeze=False
    )
    for ax, reg in zip(axes[0], regimes, strict=True):
        for d in _showcase(docs, reg):
            ys = d["series"]["variance_ms2"]
            mode = d["row"]["mode"]
            ax.plot(
                range(len(ys)),
                ys,
                label=f"{mode} (mean {d['row']['exec_time_variance']:.2f})",
                color=COLORS[mode],
                lw=1.2,
            )
        ax.set_xlabel("time (s)")
        ax.set_ylabel("exec-time variance across decode instances (ms²)")
        ax.set_yscale("symlog", linthresh=1.0)
        ax.grid(alpha=0.3)
        cells = _showcase(docs, reg)
        rate = cells[0]["row"]["rate"] if cells else "?"
        ax.set_title(f"{_title(reg, docs)}, {rate} req/s", loc="left", fontsize=10)
        ax.legend(fontsize=8)
    fig.suptitle(
        "Execution-time variance across decode instances over time (paper Fig. 10, small scale)"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def fig11(docs: Sequence[dict[str, Any]], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    regimes = sorted({d["row"]["regime"] for d in docs})
    panels = [(reg, d) for reg in regimes for d in _showcase(docs, reg)]
    # As many columns as a regime has panels (a run of 3 modes leaves no empty 4th).
    cols = max([sum(r == reg for r, _ in panels) for reg in regimes] + [1])
    rows = max(len(regimes), 1)
    fig, axes = plt.subplots(
        rows, cols, figsize=(4.2 * cols, 3.2 * rows), squeeze=False, sharey=True
    )
    for ax in axes.flat:
        ax.set_visible(False)
    for reg_i, reg in enumerate(regimes):
        for col, d in enumerate(d for r, d in panels if r == reg):
            ax = axes[reg_i][col]
            ax.set_visible(True)
            s = d["series"]
            kv = [v * 100 for v in s["max_kv"]]
            ax.plot(
                range(len(kv)), kv, color=COLORS[d["row"]["mode"]], lw=1.2, label="fullest instance"
            )
            fleet = [v * 100 for v in s.get("fleet_kv", [])]
            if fleet:
                ax.plot(
                    range(len(fleet)), fleet, color="k", lw=0.8, ls=":", label="fleet as a whole"
                )
                ax.legend(fontsize=7, loc="lower center")
            ax.axhline(99, color="k", ls="--", lw=0.8)
            for t, n in enumerate(s["preemptions"]):
                if n:
                    ax.axvspan(t, t + 1, color="orange", alpha=0.35, lw=0)
            for t in s["migrations_t"]:
                ax.axvline(t, ymin=0, ymax=0.06, color="k", lw=0.8)
            ax.set_ylim(0, 105)
            ax.set_title(
                f"{reg}, {d['row']['rate']:g} req/s: {d['row']['mode']} "
                f"({d['row']['preemptions']} preemptions, "
                f"{d['row']['migrations']} migrations)",
                fontsize=8,
                loc="left",
            )
            ax.set_xlabel("time (s)")
            if col == 0:
                ax.set_ylabel("max decode KV use (%)")
    fig.suptitle(
        "Maximum decode KV use; shaded: preemptions, ticks: migrations (paper Fig. 11)"
        + ("; device regime: emulated device timing" if "device" in regimes else "")
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def draw_all(docs: Sequence[dict[str, Any]], folder: Path) -> list[Path]:
    folder.mkdir(parents=True, exist_ok=True)
    return [
        fig9(docs, folder / "e2e-fig9.png"),
        fig10(docs, folder / "e2e-fig10-variance.png"),
        fig11(docs, folder / "e2e-fig11-kv.png"),
    ]
