"""A worker report with R-hat reaches the planner: ``predicted`` mode uses the worker's trace."""

from __future__ import annotations

import numpy as np

from scheduler.view import ClusterView
from star.planner.trace import instance_traces
from star.planner.types import Mode, PlannerParams
from workers.state import EngineStats, RunningRequest, build_report, load_trace


def report_with(predictions: dict[str, float]) -> object:
    stats = EngineStats(
        ts=0.0,
        block_size=16,
        num_blocks=1000,
        bytes_per_token=512,
        kv_usage=0.01,
        running=(RunningRequest("a", 40, 10), RunningRequest("b", 20, 100)),
        waiting=0,
        steps=10,
        decode_steps=10,
        decode_time_s=0.02,
        preemptions=0,
    )
    return build_report(
        stats,
        None,
        instance="d0",
        role="decode",
        seq=1,
        ts=0.0,
        address="x:1",
        predictions=predictions,
        delta=8,
        horizon=4,
    )


def test_predicted_mode_plans_with_the_workers_r_hat_and_trace() -> None:
    report = report_with({"a": 12.0})
    view = ClusterView(staleness_s=5.0, decision_timeout_s=5.0)
    view.apply_report(report, now=0.0)  # type: ignore[arg-type]
    params = PlannerParams(mode=Mode.parse("predicted"), horizon=4, delta=8)
    (inst,) = view.instances(params)
    assert {r.id: r.predicted_remaining for r in inst.requests} == {"a": 12.0, "b": None}
    # a (N = 50) ends after tau = 8 < 12 <= 16; b (no R-hat yet) runs on.
    expected = load_trace([(50, 12.0), (120, None)], 8, 4)
    assert expected == [170.0, 186.0, 136.0, 144.0, 152.0]
    assert list(inst.trace or ()) == report.trace == expected  # type: ignore[attr-defined]
    assert np.array_equal(instance_traces([inst], params)[0], expected)
    # Without prediction (H = 0) the planner sees the current load only.
    current = PlannerParams(mode=Mode.parse("current"), horizon=4, delta=8)
    assert instance_traces(view.instances(current), current)[0].tolist() == [170.0]
