"""Cluster-state builders and hypothesis strategies shared by the planner tests."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
from hypothesis import strategies as st

from star.planner import Instance, Mode, Move, Plan, PlannerParams, Request
from star.planner.trace import weighted_variance, weights
from star.planner.types import AUTO
from tests.planner.reference import reference_traces

MODES = ("predicted", "oracle", "current", "bins:2", "bins:4", "bins:6")


def req(rid: str, tokens: int, remaining: float | None = None, **kw: object) -> Request:
    """A request whose predicted and true remaining lengths agree unless told otherwise."""
    true = kw.pop("true_remaining", None if remaining is None else max(0, int(remaining)))
    return Request(rid, tokens, remaining, true, **kw)  # type: ignore[arg-type]


def inst(iid: str, *requests: Request, cap: int = 10**9, **kw: object) -> Instance:
    return Instance(iid, tuple(requests), cap, **kw)  # type: ignore[arg-type]


@st.composite
def params_st(draw: st.DrawFn, modes: Sequence[str] = MODES) -> PlannerParams:
    return PlannerParams(
        mode=Mode.parse(draw(st.sampled_from(modes))),
        horizon=draw(st.integers(0, 6)),
        delta=draw(st.sampled_from([1, 7, 32, 400])),
        beta_decay=draw(st.sampled_from([0.5, 0.9, 0.95, 1.0])),
        theta=draw(st.sampled_from([0.0, 0.05, 0.1, 0.3])),
        min_gain=draw(st.sampled_from([0.0, 0.0, 1e4])),
        max_migrations=draw(st.integers(1, 3) | st.just(AUTO)),
        bandwidth_bytes_per_s=draw(st.sampled_from([3.125e9, 1e7])),
        # None, a few tokens' KV, or a few requests' worth
        transfer_budget_s=draw(st.sampled_from([0.0, 0.0, 1e-4, 0.05])),
    )


@st.composite
def cluster_st(
    draw: st.DrawFn,
    params: PlannerParams,
    *,
    min_instances: int = 2,
    max_instances: int = 6,
    max_requests: int = 5,
    flags: bool = True,
    worker_traces: bool = True,
) -> list[Instance]:
    """A random cluster: skewed loads, some tight capacities, some flags set."""
    n = draw(st.integers(min_instances, max_instances))
    out: list[Instance] = []
    for i in range(n):
        scale = draw(st.sampled_from([1, 1, 2, 5]))
        reqs = []
        for j in range(draw(st.integers(0, max_requests))):
            predicted = draw(st.none() | st.floats(-5, 40_000, allow_nan=False))
            reqs.append(
                Request(
                    f"i{i}r{j}",
                    draw(st.integers(0, 3000)) * scale,
                    predicted,
                    draw(st.integers(0, 40_000)),
                    migratable=draw(st.sampled_from([True] * 5 + [False])) if flags else True,
                )
            )
        busy = frozenset(
            r.id for r in reqs if flags and draw(st.sampled_from([False] * 6 + [True]))
        )
        trace = None
        if worker_traces and params.mode.kind.value == "predicted" and draw(st.booleans()):
            length = draw(
                st.sampled_from([params.horizon + 1, params.horizon + 1, params.horizon + 2])
            )
            trace = tuple(float(draw(st.integers(0, 20_000))) for _ in range(length))
        out.append(
            Instance(
                f"i{i}",
                tuple(reqs),
                draw(st.sampled_from([5_000, 20_000, 60_000, 10**9])),
                bytes_per_token=draw(st.sampled_from([0, 1024, 131_072])),
                step_time_s=draw(st.sampled_from([0.0, 0.01, 0.05])),
                in_flight=flags and draw(st.sampled_from([False] * 7 + [True])),
                busy=busy,
                trace=trace,
                draining=flags and draw(st.sampled_from([False] * 7 + [True])),
            )
        )
    return out


def variance_of(instances: Sequence[Instance], params: PlannerParams) -> float:
    """V recomputed from scratch, request by request."""
    return weighted_variance(reference_traces(instances, params), weights(params))


def apply_moves(instances: Sequence[Instance], moves: Sequence[Move]) -> list[Instance]:
    """The cluster after the moves: each request object moves to its target."""
    by_id = {i.id: list(i.requests) for i in instances}
    for m in moves:
        r = next(r for r in by_id[m.source] if r.id == m.request)
        by_id[m.source].remove(r)
        by_id[m.target].append(r)
    return [
        Instance(i.id, tuple(by_id[i.id]), i.capacity_tokens, i.bytes_per_token, i.step_time_s)
        for i in instances
    ]


def tolerance(result: Plan) -> float:
    """Absolute slack for comparing Delta-V computed two ways (full V recomputes cancel)."""
    return 1e-9 * max(result.variance_before, 1.0) + 1e-6


def close(a: float, b: float, abs_tol: float) -> bool:
    return math.isclose(a, b, rel_tol=1e-9, abs_tol=abs_tol)


def traces(instances: Sequence[Instance], params: PlannerParams) -> np.ndarray:
    return reference_traces(instances, params)
