"""Sim-to-real: a finished e2e cell replayed through ``star simulate``'s engine.

The simulator gets the cell's own requests (arrival times, prompt and output
lengths as the client saw them), the fleet's shape, the KV capacity the
workers reported, the scheduler's tick, and the device regime's step-time
model (``base + per_token x KV tokens``, ``prefill`` per prompt token). For
the memory regime, whose steps are the CPU's, the step model is fitted to
the cell's own reports (least squares of step time on KV tokens). A
migration's fixed cost is the measured median stall (RESUMED events'
``stall_ms``; one per regime when the report re-simulates), as the paper
derives its overheads from measurements, and the KV is held in vLLM's
128-token blocks. Its
``noisy`` length predictor stands in for the tiny model's MLP in
``predicted`` mode and is exact in ``oracle`` mode.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np

from benchmarks.e2e.regimes import BLOCK

DEFAULT_HANDOFF_S = 0.025  # star simulate's default, for cells that migrated nothing
SIM_KEYS = (
    "p99_tpot_ms",
    "preemptions",
    "preemptions_of_moved",
    "exec_time_variance",
    "goodput_rps",
    "throughput_rps",
    "migrations",
)


def fitted_step(doc: dict[str, Any]) -> tuple[float, float]:
    """(base s, s per KV token) fitted to the cell's decode reports with something running."""
    xs, ys = [], []
    for s in doc["series"]["instances"].values():
        for used, ms, n in zip(s["kv_used"], s["step_ms"], s["running"], strict=True):
            if n and ms > 0:
                xs.append(used)
                ys.append(ms / 1e3)
    if len(xs) < 2 or len(set(xs)) < 2:
        return (float(np.mean(ys)) if ys else 0.005), 0.0
    slope, base = np.polyfit(np.asarray(xs, float), np.asarray(ys, float), 1)
    return max(float(base), 1e-4), max(float(slope), 0.0)


def _stalls(doc: dict[str, Any]) -> list[float]:
    return [
        float(e["data"]["stall_ms"]) / 1e3
        for e in doc.get("events", ())
        if e.get("event") == "resumed" and (e.get("data") or {}).get("stall_ms") is not None
    ]


def measured_stall_s(doc: dict[str, Any]) -> float | None:
    """The cell's median migration stall (last source token -> first target token), s."""
    stalls = _stalls(doc)
    return float(np.median(stalls)) if stalls else None


def pooled_stall_s(docs: Iterable[dict[str, Any]]) -> dict[str, float]:
    """Per regime, the median stall over every migration of its cells, s.

    One number per regime, so the simulator prices a handoff alike in every
    mode (``no-migration`` cells too: the same fixed cost is on each P->D
    transfer).
    """
    stalls: dict[str, list[float]] = {}
    for d in docs:
        stalls.setdefault(d["row"]["regime"], []).extend(_stalls(d))
    return {g: float(np.median(v)) for g, v in stalls.items() if v}


def simulate_cell(
    doc: dict[str, Any],
    records: list[dict[str, Any]],
    stall_s: float | None = None,
    *,
    blocks: bool = True,
) -> dict[str, Any]:
    """The simulator's row for the cell ``doc`` (``cell.json``) with its ``records``.

    ``stall_s`` is a D->D migration's fixed cost: by default the cell's own
    median stall, else ``DEFAULT_HANDOFF_S`` (a P->D transfer keeps that).
    With ``blocks`` the simulated KV is held in vLLM's 128-token blocks.
    """
    from star.planner.types import PlannerParams
    from star.sim.config import SimConfig
    from star.sim.engine import simulate
    from star.sim.workload import Workload

    ok = [r for r in records if _truthy(r["ok"]) and int(r["output_tokens"]) > 0]
    if not ok:
        return {}
    cfg = doc["config"]
    reg = cfg["regime"]
    row = doc["row"]
    if reg["step_base_ms"] > 0:
        base_s, per_token_s = reg["step_base_ms"] / 1e3, reg["step_us_per_token"] / 1e6
        prefill_s = reg["prefill_us_per_token"] / 1e6
    else:
        base_s, per_token_s = fitted_step(doc)
        prefill_s = 0.0
    workload = Workload(
        f"e2e-{row['regime']}-{row['mode']}",
        np.asarray([max(int(r["prompt_tokens"]), 1) for r in ok], dtype=np.int64),
        np.asarray([int(r["output_tokens"]) for r in ok], dtype=np.int64),
        np.asarray([float(r["sent_s"]) for r in ok], dtype=np.float64),
    )
    mode = row["mode"]
    if stall_s is None:
        stall_s = measured_stall_s(doc)
    measured = stall_s is not None
    if stall_s is None:
        stall_s = DEFAULT_HANDOFF_S
    block = BLOCK if blocks else 1
    # A KV pull's time per token: the regime's emulated link, else bytes over the default link.
    transfer_s = float(reg.get("transfer_us_per_token") or 0.0) / 1e6
    link_gbps = SimConfig().bandwidth_gbps
    kv_bytes = (
        max(int(transfer_s * link_gbps * 1e9 / 8), 1)
        if transfer_s > 0
        else int(cfg.get("bytes_per_token", 1024))
    )
    config = SimConfig(
        decode_instances=int(cfg["decode"]),
        prefill_instances=int(cfg["prefill"]),
        duration_s=max(float(row["duration_s"]), 1.0),
        rate_rps=float(row["rate"]),
        seed=int(row["seed"]),
        mode=mode,
        predictor="oracle" if mode == "oracle" else "noisy",
        step_base_s=base_s,
        step_per_token_s=per_token_s,
        kv_capacity_tokens=int(row.get("kv_capacity") or reg["kv_tokens"]),
        bytes_per_token=kv_bytes,
        bandwidth_gbps=link_gbps,
        handoff_latency_s=DEFAULT_HANDOFF_S,
        migration_latency_s=stall_s,
        kv_block_tokens=block,
        prefill_base_s=0.002,
        prefill_per_token_s=prefill_s,
        tick_s=0.25,
        ttft_slo_s=reg["slo_ttft_ms"] / 1e3,
        tpot_slo_s=reg["slo_tpot_ms"] / 1e3,
        max_output_tokens=max(int(cfg["cap"]), int(workload.output_tokens.max())),
        drain=True,
        planner=PlannerParams(),
    )
    result = simulate(config, workload)
    out = {k: result.row.get(k) for k in SIM_KEYS}
    out["step_model"] = {
        "base_s": base_s,
        "per_token_s": per_token_s,
        "prefill_per_token_s": prefill_s,
    }
    out["migration_latency_s"] = stall_s
    out["stall_measured"] = measured
    out["kv_block_tokens"] = block
    return out


def _truthy(value: Any) -> bool:
    return value is True or str(value) == "True"
