"""One finished cell as a document: its row, configuration, series, decisions and events (pure).

:func:`document` turns what a fleet run recorded (:class:`CellResult`) into
what ``cell.json`` and ``requests.csv`` hold; everything the table, the
figures and the sim-to-real comparison read comes from here.
"""

from __future__ import annotations

from dataclasses import asdict, replace
from typing import Any

from benchmarks.e2e.fleet import CellResult
from benchmarks.e2e.metrics import (
    fleet_kv_over_time,
    instance_series,
    max_kv_over_time,
    migrations_per_request,
    preemption_bins,
    records_as_rows,
    summarize,
    variance_over_time,
)
from benchmarks.e2e.regimes import Regime
from benchmarks.e2e.report import Cell, cluster_name
from benchmarks.serve import Slo
from star.predictor.live import replay as live_accuracy


def document(
    cell: Cell, workload: str, reg: Regime, res: CellResult, config: dict[str, Any]
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """(``cell.json``'s document, ``requests.csv``'s rows) of a finished cell.

    ``config`` is recorded as given, next to the regime's settings.
    """
    series = instance_series(res.reports, res.t0)
    migrated = migrations_per_request(res.events)
    records = [replace(r, migrations=migrated.get(r.request_id, 0)) for r in res.records]
    summary = summarize(
        records,
        series,
        res.decisions,
        res.events,
        res.duration_s,
        Slo(reg.slo_ttft_ms, reg.slo_tpot_ms),
    )
    # The live predictor's accuracy over the run, as the scheduler's /metrics has it.
    live = live_accuracy(res.reports, res.events)
    row = {
        "regime": cell.regime,
        "cluster": cluster_name(int(config.get("prefill", 1)), int(config.get("decode", 3))),
        "workload": workload,
        "mode": cell.mode,
        "rate": cell.rate,
        "seed": cell.seed,
        "timing": reg.label,
        **summary,
        "live_mae": live["mae"],
    }
    doc: dict[str, Any] = {
        "row": row,
        "config": {"regime": asdict(reg), "workload": workload, **config, "ready_s": res.ready_s},
        "series": {
            "variance_ms2": variance_over_time(series, res.duration_s),
            "max_kv": max_kv_over_time(series, res.duration_s),
            "fleet_kv": fleet_kv_over_time(series, res.duration_s),
            "preemptions": preemption_bins(series, res.duration_s),
            "migrations_t": sorted(d.ts - res.t0 for d in res.decisions),
            "instances": {name: asdict(s) for name, s in series.items()},
        },
        "decisions": [
            {
                "t": d.ts - res.t0,
                "request": d.request,
                "source": d.source,
                "target": d.target,
                "delta_v": d.delta_v,
                "reason": d.reason,
            }
            for d in res.decisions
        ],
        "events": [
            {
                "t": e.ts - res.t0,
                "event": e.event.value,
                "request": e.request,
                "instance": e.instance,
                "migration": e.migration,
                "detail": e.detail,
                "data": e.data,
            }
            for e in res.events
        ],
        "predictor_live": live,
    }
    return doc, records_as_rows(records)
