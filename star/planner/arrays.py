"""The planner on flat arrays: one tick of paper Algorithm 1 without per-request objects.

:func:`plan_arrays` is the planner. :func:`star.planner.plan` (the live
scheduler, ``star plan``) converts its :class:`~star.planner.Instance` values
with :func:`from_instances` and calls it; the simulator builds
:class:`ClusterArrays` from its own state, so both run the same code.
Each candidate's Delta-V and capacity check are O(1) from prefix sums, and
the search returns exactly the full enumeration's argmin (the greedy
sequence of them with several moves per tick); the algebra:
docs/plan-state.md, "How a candidate is evaluated".
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import lru_cache
from itertools import chain
from operator import attrgetter
from types import ModuleType
from typing import Any

import numpy as np

from star.planner.trace import (
    MIN_REMAINING,
    PAPER_SCALE_TOKENS,
    BoolArray,
    FloatArray,
    IntArray,
    _bin_values,
    grid,
    weights,
)
from star.planner.types import AUTO, Instance, Mode, ModeKind, PlannerParams, validate_params

# Delta-V is a difference of sums that can cancel exactly: moving the only
# request of s onto an empty t just swaps the two traces (Delta-V = 0), and
# rounding may then show a "gain" of -1e-9 that would migrate back and forth
# forever. A gain no larger than this many ulps of the candidate's own term
# magnitude, sum_j beta_j c_j (c_j + L_s + L_t), counts as no gain.
_NOISE_ULPS = 8.0

# Classification compares w_i with (1+theta) times a mean of the w_i; with
# theta = 0 and identical instances the rounding of the mean alone would call
# them all overloaded. Comparisons are made this much (relative) past the bound.
CLASSIFY_RTOL = 1e-12


def _kernels() -> ModuleType:
    # numba takes ~0.5-1 s to import: only processes that plan pay for it
    # (``star status`` and other CLI commands import this package too).
    from star.planner import kernels

    return kernels


def noise_floor(points: int) -> float:
    """Relative size below which a Delta-V is rounding noise (H + 1 = ``points``)."""
    return _NOISE_ULPS * (points + 16) * float(np.finfo(np.float64).eps)


@dataclass(frozen=True, slots=True)
class ClusterArrays:
    """The decode instances at one tick as flat arrays (the planner's input).

    Requests are rows grouped by instance: instance i owns rows
    ``offsets[i]:offsets[i + 1]``, in the order ties are broken in.
    ``predicted`` is R-hat from the length predictor (NaN: no prediction
    yet), ``true_remaining`` the true remaining length (NaN: not known, read
    like a missing prediction; only ``oracle`` mode uses it), ``eligible``
    whether a request may be moved (migratable and not already migrating).
    Per instance: KV capacity in
    tokens, bytes per token, mean step time (0: unknown, the params' default
    is used), whether it takes part in a migration already, and optionally
    the worker's own pre-simulated trace (``traces`` rows where
    ``has_trace``; used only in ``predicted`` mode with H + 1 points, as
    :func:`star.planner.trace.uses_worker_trace` says) and whether it is
    ``draining`` (None: none is; a draining instance is never underloaded,
    so never a target).
    """

    offsets: IntArray
    tokens: FloatArray
    predicted: FloatArray
    true_remaining: FloatArray
    eligible: BoolArray
    capacity: FloatArray
    bytes_per_token: FloatArray
    step_time_s: FloatArray
    in_flight: BoolArray
    traces: FloatArray | None = None
    has_trace: BoolArray | None = None
    draining: BoolArray | None = None

    @property
    def size(self) -> int:
        """Number of instances."""
        return int(self.offsets.size) - 1


@dataclass(frozen=True, slots=True)
class ArrayPlan:
    """:func:`plan_arrays`' outcome: moves as (request row, source, target) indices."""

    rows: IntArray
    sources: IntArray
    targets: IntArray
    delta_v: FloatArray
    remaining: FloatArray  # R-hat of each moved request, as the planner saw it
    workloads: FloatArray
    mean_workload: float
    overloaded: BoolArray
    underloaded: BoolArray
    variance_before: float
    variance_after: float
    traces: FloatArray  # L_i(tau_j) the decision was made on, shape (n, H + 1)
    remaining_all: FloatArray  # R-hat of every row


@dataclass(frozen=True, slots=True)
class _Constants:
    beta: FloatArray
    tau: FloatArray
    noise: float


@lru_cache(maxsize=64)
def _constants(params: PlannerParams) -> _Constants:
    validate_params(params)
    tau = grid(params)
    return _Constants(weights(params), tau, noise_floor(tau.size))


def move_limit(params: PlannerParams, overloaded: int) -> int:
    """M this tick: ``max_migrations``, or with ``auto`` |O| (``overloaded``)."""
    m = params.max_migrations
    return overloaded if m == AUTO else int(m)


def transfer_budget(params: PlannerParams) -> float:
    """KV bytes a tick's moves after the first may carry in all (inf: no budget)."""
    if params.transfer_budget_s <= 0:
        return float("inf")
    return params.transfer_budget_s * params.bandwidth_bytes_per_s


def remaining_of(
    arrays: ClusterArrays, mode: Mode, scale: float = PAPER_SCALE_TOKENS
) -> FloatArray:
    """R-hat of every row as ``mode`` sees it (:func:`star.planner.remaining_for`).

    ``scale`` is the params' ``bins_scale_tokens`` (the ``bins:K`` edges').
    """
    kind = mode.kind
    if kind is ModeKind.CURRENT or kind is ModeKind.NO_MIGRATION:
        return np.full(arrays.tokens.size, np.inf)
    if kind is ModeKind.ORACLE:
        true = arrays.true_remaining  # NaN: not known, read as in predicted mode
        out: FloatArray = np.where(np.isnan(true), np.inf, np.maximum(true, MIN_REMAINING))
        return out
    pred = arrays.predicted
    if kind is ModeKind.BINS:
        pred = _bin_values(pred, mode.bins, scale)
    out = np.where(np.isnan(pred), np.inf, np.maximum(pred, MIN_REMAINING))
    return out


def plan_arrays(arrays: ClusterArrays, params: PlannerParams) -> ArrayPlan:
    """Decide this tick's migrations (paper Algorithm 1; docs/design.md §3) on flat arrays.

    Phase 1, "Instance Classification (Lines 11-16)": w_i = sum_j beta_j
    L_i(tau_j); O = {i : w_i > (1+theta) w-bar}; U = {i : L_i(0) < (1+theta)
    w-bar}, draining instances left out of U. Phases 2 and 3 run in
    :func:`star.planner.kernels.select`. The contract is
    :func:`star.planner.plan`'s.
    """
    const = _constants(params)
    beta, tau = const.beta, const.tau
    n = arrays.size
    remaining = remaining_of(arrays, params.mode, params.bins_scale_tokens)
    kernels = _kernels()
    k = kernels.cutoffs(remaining, tau)
    if (
        params.mode.kind is ModeKind.PREDICTED
        and arrays.traces is not None
        and arrays.has_trace is not None
        and arrays.traces.shape[1] == tau.size
    ):
        need = ~arrays.has_trace
        given = np.asarray(arrays.traces, dtype=np.float64)
        traces = given.copy() if need.any() else given
    else:
        need = np.ones(n, dtype=np.bool_)
        traces = np.empty((n, tau.size))
    if need.any():
        kernels.fill_traces(arrays.offsets, arrays.tokens, k, tau, need, traces)

    work = traces @ beta
    mean = float(work.mean()) if n else 0.0
    bound = (1.0 + params.theta) * mean
    slack = CLASSIFY_RTOL * abs(bound)
    over = work > bound + slack
    under = traces[:, 0] < bound - slack
    if arrays.draining is not None:
        under &= ~arrays.draining  # takes no new requests; may still be a source
    variance = kernels.weighted_variance(traces, beta)

    def nothing() -> ArrayPlan:
        empty = np.empty(0, dtype=np.intp)
        return ArrayPlan(
            empty, empty, empty, np.empty(0), np.empty(0), work, mean, over, under,
            variance, variance, traces, remaining,
        )  # fmt: skip

    # Algorithm 1 line 6: nothing to do unless some instance is overloaded.
    limit = move_limit(params, int(np.count_nonzero(over)))
    if params.mode.kind is ModeKind.NO_MIGRATION or limit == 0:
        return nothing()
    sources = over & ~arrays.in_flight
    targets = under & ~arrays.in_flight
    if not sources.any() or not targets.any():
        return nothing()
    step = np.where(arrays.step_time_s > 0, arrays.step_time_s, params.default_step_time_s)
    rows, picked, values = kernels.select(
        traces,
        beta,
        tau,
        arrays.capacity,
        sources,
        targets,
        arrays.offsets,
        arrays.tokens,
        remaining,
        k,
        arrays.eligible,
        arrays.bytes_per_token,
        step,
        float(params.bandwidth_bytes_per_s),
        float(params.handoff_latency_s),
        -params.min_gain * n / 2.0,  # Delta-V < -epsilon, in (n/2)-scaled units
        const.noise,
        limit,
        transfer_budget(params),
    )
    if not rows.size:
        return nothing()
    owners = np.searchsorted(arrays.offsets, rows, side="right") - 1
    after = kernels.variance_after(
        traces, beta, tau, rows, owners, picked, remaining, arrays.tokens
    )
    return ArrayPlan(
        rows=rows,
        sources=owners.astype(np.intp),
        targets=picked,
        delta_v=values * 2.0 / n,
        remaining=remaining[rows],
        workloads=work,
        mean_workload=mean,
        overloaded=over,
        underloaded=under,
        variance_before=variance,
        variance_after=after,
        traces=traces,
        remaining_all=remaining,
    )


_TOKENS = attrgetter("tokens")
_PREDICTED = attrgetter("predicted_remaining")
_TRUE = attrgetter("true_remaining")
_MIGRATABLE = attrgetter("migratable")


_NAN = float("nan")


def _floats_or_nan(values: Iterable[float | int | None], count: int) -> FloatArray:
    """``values`` as float64, None as NaN (~30 % cheaper than ``np.array(list)``,
    which would look at every item's type twice)."""
    return np.fromiter([_NAN if v is None else v for v in values], np.float64, count)


def planner_columns(params: PlannerParams) -> tuple[str, ...]:
    """The request columns (:func:`request_column`) and ``trace`` that a tick in
    ``params``' mode reads; the others stay NaN (unknown)."""
    kind = params.mode.kind
    if kind is ModeKind.PREDICTED:
        return ("tokens", "eligible", "predicted", "trace")
    if kind is ModeKind.BINS:
        return ("tokens", "eligible", "predicted")
    if kind is ModeKind.ORACLE:
        return ("tokens", "eligible", "true_remaining")
    return ("tokens", "eligible")


def request_column(
    name: str, requests: Sequence[Any], busy: frozenset[str] = frozenset()
) -> np.ndarray:
    """One :class:`ClusterArrays` column of ``requests`` (planner :class:`Request`
    values or reported :class:`~star.wire.RequestLoad` ones: the same fields):
    ``tokens``; ``predicted`` / ``true_remaining`` (float64, None as NaN, which
    remaining_of reads as unknown); ``eligible`` (migratable, not in ``busy``)."""
    n = len(requests)
    if name == "tokens":
        # Via int64: numpy converts ints to int64 ~1.6x faster than to float64.
        return np.fromiter(map(_TOKENS, requests), np.int64, n).astype(np.float64)
    if name == "predicted":
        return _floats_or_nan(map(_PREDICTED, requests), n)
    if name == "true_remaining":
        return _floats_or_nan(map(_TRUE, requests), n)
    if name == "eligible":
        # Nearly every request is migratable: one C-level pass says so, else one per row.
        if not busy and all(map(_MIGRATABLE, requests)):
            return np.ones(n, dtype=np.bool_)
        return np.fromiter([r.migratable and r.id not in busy for r in requests], np.bool_, n)
    raise ValueError(f"no request column {name!r}")


def from_instances(instances: Sequence[Instance], params: PlannerParams) -> ClusterArrays:
    """The arrays of ``instances`` (what :func:`star.planner.plan` hands :func:`plan_arrays`)."""
    groups = [inst.requests for inst in instances]
    counts = np.fromiter(map(len, groups), dtype=np.intp, count=len(groups))
    offsets = np.zeros(len(groups) + 1, dtype=np.intp)
    np.cumsum(counts, out=offsets[1:])
    reqs = list(chain.from_iterable(groups))
    total = len(reqs)
    names = planner_columns(params)

    def column(name: str) -> np.ndarray:
        return request_column(name, reqs) if name in names else np.full(total, np.nan)

    tokens, eligible = column("tokens"), column("eligible")
    predicted, true = column("predicted"), column("true_remaining")
    for i, inst in enumerate(instances):
        if inst.busy:
            start = int(offsets[i])
            for j, r in enumerate(inst.requests):
                if r.id in inst.busy:
                    eligible[start + j] = False
    traces: FloatArray | None = None
    has: BoolArray | None = None
    draining = np.array([inst.draining for inst in instances], dtype=np.bool_)
    points = grid(params).size
    if "trace" in names:
        has = np.array(
            [inst.trace is not None and len(inst.trace) == points for inst in instances],
            dtype=np.bool_,
        )
        if has.any():
            traces = np.zeros((len(instances), points))
            for i in np.flatnonzero(has).tolist():
                traces[i] = np.asarray(instances[i].trace, dtype=np.float64)
    return ClusterArrays(
        offsets=offsets,
        tokens=tokens,
        predicted=predicted,
        true_remaining=true,
        eligible=eligible,
        capacity=np.array([inst.capacity_tokens for inst in instances], dtype=np.float64),
        bytes_per_token=np.array([inst.bytes_per_token for inst in instances], dtype=np.float64),
        step_time_s=np.array([inst.step_time_s for inst in instances], dtype=np.float64),
        in_flight=np.array([inst.in_flight for inst in instances], dtype=np.bool_),
        traces=traces,
        has_trace=has if traces is not None else None,
        draining=draining if draining.any() else None,
    )
