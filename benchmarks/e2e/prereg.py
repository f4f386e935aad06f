"""Pre-registration: what ``star simulate`` predicts for every cell of a sweep, before it runs.

``star bench e2e ... --predict FILE`` builds each cell's seeded schedule (the
same requests the fleet will get), replays it through the simulator with the
regime's step model (:func:`benchmarks.e2e.simreal.simulate_cell`), and writes
the predictions with the date, the commit and the knee the rule below picks,
so they can be committed before the fleet runs. ``--prediction FILE`` puts
them beside the fleet's results in the comparison table.

The knee rule, fixed here: per regime, the lowest swept rate at which the
simulated baseline (``no-migration``, mean over seeds) meets the SLO for
less than :data:`KNEE_ATTAINMENT` of its finished requests; none when it
meets it at every rate.

Output lengths must be known before the run: ``replay`` and ShareGPT
workloads (``ignore_eos``) qualify, ``task`` (natural lengths) does not.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import subprocess
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.e2e.regimes import regime
from benchmarks.e2e.report import Cell, cluster_name
from benchmarks.e2e.workload import Workload, schedule

KNEE_ATTAINMENT = 0.95
KNEE_RULE = (
    "per regime, the lowest swept rate at which the simulated no-migration baseline "
    f"(mean over seeds) meets the SLO for less than {KNEE_ATTAINMENT:.0%} of its finished requests"
)


class PredictionError(ValueError):
    """The sweep cannot be predicted as asked (``str()`` says why)."""


def predict(
    cells: Sequence[Cell],
    workload: Workload,
    count_prompt: Callable[[Any], int],
    *,
    num_prompts: int,
    kv_requests: float,
    max_model_len: int,
    dilation: float = 1.0,
    prefill: int,
    decode: int,
    bytes_per_token: int,
) -> list[dict[str, Any]]:
    """The simulator's row for every cell (``count_prompt``: a request's prompt -> tokens)."""
    from benchmarks.e2e.simreal import simulate_cell

    if not workload.known_lengths:
        raise PredictionError(
            f"workload {workload.name!r} has natural output lengths, known only by running it; "
            "pre-register a replay or ShareGPT workload (ignore_eos, lengths fixed)"
        )
    out = []
    for cell in cells:
        reg = regime(cell.regime, workload.cap, kv_requests, max_model_len, dilation)
        if not reg.emulated:
            raise PredictionError(
                f"regime {cell.regime!r} runs on the CPU's own step times, which the simulator "
                "learns from a finished cell; pre-register the device regime"
            )
        requests, times = schedule(workload, num_prompts, cell.rate / reg.dilation, cell.seed)
        records = [
            {
                "ok": True,
                "prompt_tokens": count_prompt(r.prompt),
                "output_tokens": r.max_tokens,
                "sent_s": t,
            }
            for r, t in zip(requests, times, strict=True)
        ]
        doc = {
            "config": {
                "regime": dataclasses.asdict(reg),  # as a finished cell records it
                "decode": decode,
                "prefill": prefill,
                "cap": workload.cap,
                "bytes_per_token": bytes_per_token,
            },
            "row": {
                "regime": cell.regime,
                "mode": cell.mode,
                "rate": cell.rate,
                "seed": cell.seed,
                "duration_s": max(times) if times else 1.0,
                "kv_capacity": reg.kv_tokens,
            },
        }
        sim = simulate_cell(doc, records)
        out.append(
            {
                "regime": cell.regime,
                "cluster": cluster_name(prefill, decode),
                "mode": cell.mode,
                "rate": cell.rate,
                "seed": cell.seed,
                **{
                    k: sim.get(k)
                    for k in ("p99_tpot_ms", "preemptions", "preemptions_of_moved", "migrations")
                },
                "slo_attainment": _attainment(sim),
            }
        )
    return out


def _attainment(sim: dict[str, Any]) -> float | None:
    good, done = sim.get("goodput_rps"), sim.get("throughput_rps")
    return float(good) / float(done) if good is not None and done else None


def knees(cells: Sequence[dict[str, Any]]) -> dict[str, float | None]:
    """The knee of each regime by :data:`KNEE_RULE`."""
    by_rate: dict[str, dict[float, list[float]]] = {}
    for c in cells:
        if c["mode"] == "no-migration" and c["slo_attainment"] is not None:
            by_rate.setdefault(c["regime"], {}).setdefault(float(c["rate"]), []).append(
                float(c["slo_attainment"])
            )
    out: dict[str, float | None] = {}
    for reg, rates in by_rate.items():
        below = [r for r, v in sorted(rates.items()) if float(np.mean(v)) < KNEE_ATTAINMENT]
        out[reg] = below[0] if below else None
    return out


def write(path: Path, cells: list[dict[str, Any]], design: dict[str, Any]) -> dict[str, Any]:
    """Write the registration (predictions, knee, date, commit, design) to ``path``."""
    doc = {
        "registered": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "commit": _commit(),
        "design": design,
        "knee_rule": KNEE_RULE,
        "knee": knees(cells),
        "cells": cells,
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=1))
    return doc


def _git(*args: str) -> str | None:
    try:
        return subprocess.run(
            ["git", *args], capture_output=True, text=True, check=True, cwd=Path(__file__).parent
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def _commit() -> str | None:
    return _git("rev-parse", "--short", "HEAD")


def source_tree() -> dict[str, Any]:
    """The commit this code runs from and whether tracked files differ from it (None: no git)."""
    status = _git("status", "--porcelain", "--untracked-files=no")
    return {"commit": _commit(), "tree_modified": None if status is None else bool(status)}


def load(path: Path) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads(path.read_text())
    if "cells" not in doc or "knee" not in doc:
        raise PredictionError(f"{path} is not a pre-registration written by --predict")
    return doc


def predicted_p99(
    doc: dict[str, Any], seeds: Callable[[tuple[str, str, float, str]], Sequence[int]] | None = None
) -> dict[tuple[str, str, float, str], float]:
    """Mean over seeds of the predicted P99 TPOT, per (regime, cluster, rate, mode).

    ``seeds(key)``: the seeds to average over, those the fleet ran (a sweep
    that has run 1 of 5 seeds is compared with that seed's prediction, not
    with a mean that other seeds' overloads dominate); default every seed
    registered. A registration written before cells named their cluster has
    its design's shape.
    """
    design = doc.get("design") or {}
    shape = cluster_name(int(design.get("prefill", 1)), int(design.get("decode", 3)))
    groups: dict[tuple[str, str, float, str], dict[int, float]] = {}
    for c in doc["cells"]:
        if c.get("p99_tpot_ms") is not None:
            key = (c["regime"], c.get("cluster") or shape, float(c["rate"]), c["mode"])
            groups.setdefault(key, {})[int(c["seed"])] = float(c["p99_tpot_ms"])
    out = {}
    for key, by_seed in groups.items():
        wanted = by_seed if seeds is None else [s for s in seeds(key) if s in by_seed]
        if wanted:
            out[key] = float(np.mean([by_seed[s] for s in wanted]))
    return out
