"""The e2e results directory: one folder per cell, resumable, and the tables made from it.

Layout: ``OUT/<regime>/<mode>/rate-<r>/seed-<s>/`` holds ``cell.json`` (the
row, the cell's configuration, the time series behind the figures, decisions
and migration outcomes) and ``requests.csv`` (one line per client request).
A cell whose ``cell.json`` exists is finished and is skipped on the next run.
"""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.e2e.metrics import interval
from star.sim.report import markdown_table

MODES = ("no-migration", "current", "predicted", "oracle")
ROW_KEYS = (
    "regime",
    "cluster",
    "workload",
    "mode",
    "rate",
    "seed",
    "goodput",
    "throughput",
    "p99_tpot_ms",
    "p99_ttft_ms",
    "preemptions",
    "migrations",
    "exec_time_variance",
    "max_kv_use",
    "fleet_kv_peak",
    "slo_met",
    "pad_share",
    "live_mae",
)
MEASURED = ROW_KEYS[ROW_KEYS.index("goodput") :]  # what aggregate() averages over seeds


@dataclass(frozen=True, slots=True)
class Cell:
    regime: str
    mode: str
    rate: float
    seed: int

    def path(self, out: Path) -> Path:
        return out / self.regime / self.mode / f"rate-{self.rate:g}" / f"seed-{self.seed}"


def write_cell(
    out: Path, cell: Cell, doc: dict[str, Any], requests: Sequence[dict[str, Any]]
) -> Path:
    """Write a finished cell (``cell.json`` last: its presence marks the cell done)."""
    folder = cell.path(out)
    folder.mkdir(parents=True, exist_ok=True)
    if requests:
        with (folder / "requests.csv").open("w", newline="") as fh:
            writer = csv.DictWriter(fh, fieldnames=list(requests[0]))
            writer.writeheader()
            writer.writerows(requests)
    tmp = folder / "cell.json.tmp"
    tmp.write_text(json.dumps(doc, indent=1, default=_plain))
    tmp.replace(folder / "cell.json")
    return folder / "cell.json"


def _plain(value: Any) -> Any:
    if isinstance(value, float) and math.isnan(value):
        return None
    raise TypeError(f"not JSON: {type(value).__name__}")


def load_cell(out: Path, cell: Cell) -> dict[str, Any] | None:
    path = cell.path(out) / "cell.json"
    if not path.exists():
        return None
    doc: dict[str, Any] = json.loads(path.read_text())
    return doc


def load_requests(out: Path, cell: Cell) -> list[dict[str, Any]]:
    """A finished cell's ``requests.csv`` rows (strings, as written)."""
    path = cell.path(out) / "requests.csv"
    if not path.exists():
        return []
    with path.open(newline="") as fh:
        return list(csv.DictReader(fh))


def cluster_name(prefill: int, decode: int) -> str:
    """A fleet shape as the report names it: ``1P+3D`` (the paper's small cluster), ``2P+6D``."""
    return f"{prefill}P+{decode}D"


def cluster_of(doc: dict[str, Any]) -> str:
    """The fleet shape of a cell (or a pre-registered cell) from its configuration.

    Cells written before the shape was recorded ran the bench's only shape
    then, 1 prefill + 3 decode workers (its defaults).
    """
    config = doc.get("config") or {}
    return str(
        doc.get("row", {}).get("cluster")
        or cluster_name(int(config.get("prefill", 1)), int(config.get("decode", 3)))
    )


def group_of(doc: dict[str, Any]) -> tuple[str, str, float, str]:
    """The comparison row a cell belongs to: (regime, cluster, rate, mode)."""
    r = doc["row"]
    return str(r["regime"]), cluster_of(doc), float(r["rate"]), str(r["mode"])


def cell_of(doc: dict[str, Any]) -> Cell:
    r = doc["row"]
    return Cell(r["regime"], r["mode"], float(r["rate"]), int(r["seed"]))


def load_all(out: Path) -> list[dict[str, Any]]:
    """Every finished cell under ``out``."""
    return [json.loads(p.read_text()) for p in sorted(out.glob("*/*/rate-*/seed-*/cell.json"))]


def row(doc: dict[str, Any]) -> dict[str, Any]:
    """The cell's row (``--json``): ROW_KEYS plus the label of its timing."""
    out = {k: doc["row"].get(k) for k in ROW_KEYS}
    out["timing"] = doc["row"].get("timing")
    return out


def _num(v: Any) -> float:
    return math.nan if v is None else float(v)


def aggregate(rows: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """Rows grouped by (regime, rate, mode): mean and 95 % interval over seeds, ratios vs no-migration."""
    groups: dict[tuple[str, float, str], list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault((r["regime"], float(r["rate"]), r["mode"]), []).append(r)
    out = []
    for (reg, rate, mode), rs in sorted(
        groups.items(), key=lambda kv: (kv[0][0], kv[0][1], _mode_order(kv[0][2]))
    ):
        agg: dict[str, Any] = {
            "regime": reg,
            "rate": rate,
            "mode": mode,
            "seeds": len(rs),
            "timing": rs[0].get("timing"),
        }
        for key in MEASURED:
            mean, lo, hi = interval([_num(r.get(key)) for r in rs])
            agg[key] = mean
            agg[key + "_ci"] = (lo, hi)
        out.append(agg)
    base = {(a["regime"], a["rate"]): a for a in out if a["mode"] == "no-migration"}
    for a in out:
        b = base.get((a["regime"], a["rate"]))
        if b is None:
            continue
        a["tpot_reduction"] = (
            1.0 - a["p99_tpot_ms"] / b["p99_tpot_ms"] if b["p99_tpot_ms"] else math.nan
        )
        a["goodput_ratio"] = a["goodput"] / b["goodput"] if b["goodput"] else math.inf
    return out


def _mode_order(mode: str) -> int:
    return MODES.index(mode) if mode in MODES else len(MODES)


def _fmt(v: Any, spec: str) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    return format(v, spec)


def _ci(a: dict[str, Any], key: str, spec: str) -> str:
    lo, hi = a[key + "_ci"]
    text = _fmt(a[key], spec)
    if a["seeds"] > 1 and not math.isnan(lo):
        text += f" [{_fmt(lo, spec)}, {_fmt(hi, spec)}]"
    return text


def table(aggs: Sequence[dict[str, Any]]) -> str:
    """The e2e table of docs/results.md: one line per (regime, rate, mode)."""
    head = (
        "regime",
        "rate",
        "mode",
        "seeds",
        "P99 TPOT ms",
        "vs no-mig.",
        "goodput req/s",
        "× no-mig.",
        "SLO met",
        "preemptions",
        "migrations",
        "exec-time var. ms²",
        "max KV",
        "padding",
    )
    rows = []
    for a in aggs:
        label = a["regime"] + (
            " (emulated device timing)" if a.get("timing") == "emulated device timing" else ""
        )
        base = "—" if a["mode"] == "no-migration" else ""  # the baseline itself
        rows.append(
            (
                label,
                f"{a['rate']:g}",
                a["mode"],
                a["seeds"],
                _ci(a, "p99_tpot_ms", ".1f"),
                base or _pct(a.get("tpot_reduction")),
                _ci(a, "goodput", ".2f"),
                base or _fmt(a.get("goodput_ratio"), ".2f") + "×",
                f"{_fmt(a['slo_met'] * 100, '.0f')} %",
                _ci(a, "preemptions", ".1f"),
                _ci(a, "migrations", ".1f"),
                _fmt(a["exec_time_variance"], ".2f"),
                f"{_fmt(a['max_kv_use'] * 100, '.0f')} %",
                f"{_fmt(a['pad_share'] * 100, '.0f')} %",
            )
        )
    return markdown(head, rows)


def markdown(head: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """The e2e report's markdown tables: ``star simulate``'s printer, cells formatted here."""
    return markdown_table(head, rows).rstrip("\n")


def _pct(v: Any) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    return f"{-v * 100:+.1f} %"


def sim_table(docs: Sequence[dict[str, Any]]) -> str:
    """Sim against real, per (regime, rate, mode), means over seeds (``star simulate``'s engine)."""
    groups: dict[tuple[str, float, str], list[dict[str, Any]]] = {}
    for d in docs:
        if d.get("sim"):
            r = d["row"]
            groups.setdefault((r["regime"], float(r["rate"]), r["mode"]), []).append(d)
    head = (
        "regime",
        "rate",
        "mode",
        "P99 TPOT real / sim ms",
        "sim vs real",
        "preemptions real / sim",
        "exec-time var. real / sim ms²",
        "migrations real / sim",
    )
    rows = []
    for (reg, rate, mode), ds in sorted(
        groups.items(), key=lambda kv: (kv[0][0], kv[0][1], _mode_order(kv[0][2]))
    ):

        def mean(src: str, key: str, ds: list[dict[str, Any]] = ds) -> float:
            vals = [_num(d[src].get(key)) for d in ds]
            return sum(vals) / len(vals)

        real_p99, sim_p99 = mean("row", "p99_tpot_ms"), mean("sim", "p99_tpot_ms")
        gap = sim_p99 / real_p99 - 1.0 if real_p99 else math.nan
        rows.append(
            (
                reg,
                f"{rate:g}",
                mode,
                f"{real_p99:.1f} / {sim_p99:.1f}",
                f"{gap * 100:+.0f} %",
                f"{mean('row', 'preemptions'):.1f} / {mean('sim', 'preemptions'):.1f}",
                f"{mean('row', 'exec_time_variance'):.2f} / {mean('sim', 'exec_time_variance'):.2f}",
                f"{mean('row', 'migrations'):.1f} / {mean('sim', 'migrations'):.1f}",
            )
        )
    return markdown(head, rows)


def live_table(docs: Sequence[dict[str, Any]]) -> str:
    """The live predictor's MAE (tokens) by tokens generated, per regime and mode, over every cell.

    Points and absolute errors are added up across cells before dividing, so
    a cell with many points weighs more (as one long run would).
    """
    groups: dict[tuple[str, str], dict[str, list[float]]] = {}
    labels: list[str] = []
    for d in docs:
        live = d.get("predictor_live") or {}
        if not live.get("points"):
            continue
        g = groups.setdefault((d["row"]["regime"], d["row"]["mode"]), {})
        for b in live["buckets"]:
            if b["bucket"] not in labels:
                labels.append(b["bucket"])
            acc = g.setdefault(b["bucket"], [0.0, 0.0])
            if b["points"]:
                acc[0] += b["points"]
                acc[1] += b["points"] * b["mae"]
        total = g.setdefault("all", [0.0, 0.0])
        total[0] += live["points"]
        total[1] += live["points"] * live["mae"]
    head = ("regime", "mode", "points", "MAE", *(f"{x} generated" for x in labels))
    rows = []
    for (reg, mode), g in sorted(groups.items(), key=lambda kv: (kv[0][0], _mode_order(kv[0][1]))):

        def mae(key: str, g: dict[str, list[float]] = g) -> str:
            n, err = g.get(key, [0.0, 0.0])
            return f"{err / n:.0f}" if n else "-"

        rows.append((reg, mode, f"{g['all'][0]:.0f}", mae("all"), *(mae(x) for x in labels)))
    return markdown(head, rows)
