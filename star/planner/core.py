"""One scheduler tick of paper Algorithm 1 ("Decode Rescheduling"), sans IO.

Paper §5.2: "The scheduler periodically collects pre-simulated state reports
from all workers, classifies instances, enumerates candidates, and completes
the remaining simulation to select the best feasible migration." This module
is that tick as a pure function of the reported state (docs/design.md §3 makes it
exact). :func:`decide` is the one entry, on arrays: Algorithm 1
(:func:`star.planner.arrays.plan_arrays`) then the drain evacuations
(:mod:`star.planner.drain`); the simulator calls it on its own arrays, and
:func:`plan` takes :class:`~star.planner.Instance` values (the live
scheduler, ``star plan``) and calls it on arrays built from them. The algebra that makes each Delta-V O(1) is
in :mod:`star.planner.arrays`; ``explain=True`` lists every candidate with
its verdict, from the search's own kernels (:mod:`star.planner.kernels`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import repeat

import numpy as np

from star.planner.arrays import (
    CLASSIFY_RTOL,
    ArrayPlan,
    ClusterArrays,
    from_instances,
    noise_floor,
    plan_arrays,
)
from star.planner.drain import evacuations
from star.planner.trace import (
    BoolArray,
    FloatArray,
    IntArray,
    cutoffs,
    grid,
    remaining_array,
    too_short,
    weights,
)
from star.planner.types import (
    BALANCE,
    DRAIN,
    Candidate,
    Instance,
    ModeKind,
    Move,
    Plan,
    PlannerParams,
    Verdict,
    validate_params,
)

_VERDICTS = tuple(Verdict)
_CODE = {v: i for i, v in enumerate(_VERDICTS)}

__all__ = [
    "CLASSIFY_RTOL",
    "TickMoves",
    "decide",
    "noise_floor",
    "plan",
]


def _explain(
    instances: Sequence[Instance],
    over: BoolArray,
    under: BoolArray,
    tables: tuple[FloatArray, FloatArray, FloatArray, FloatArray, FloatArray, FloatArray],
    params: PlannerParams,
    tau: FloatArray,
    moves: Sequence[Move],
) -> tuple[Candidate, ...]:
    """Every (r, s, t) of O x U (t != s) with its Delta-V and verdict, in (s, t, r) order.

    The values come from the search's own functions
    (:func:`star.planner.kernels.candidate_values` on :func:`~star.planner.kernels.prefix_tables`).
    """
    from star.planner import kernels

    n = len(instances)
    threshold = -params.min_gain * n / 2.0
    noise = noise_floor(tau.size)
    under_idx = np.flatnonzero(under)
    out: list[Candidate] = []
    for s in np.flatnonzero(over):
        src = instances[s]
        targets = under_idx[under_idx != s]
        if not src.requests or targets.size == 0:
            continue
        reqs = src.requests
        tokens = np.array([r.tokens for r in reqs], dtype=np.float64)
        remaining = remaining_array(reqs, params.mode, params.bins_scale_tokens)
        k = cutoffs(remaining, tau)
        unscaled, feasible, size = kernels.candidate_values(tokens, k, int(s), targets, tables)
        gain = unscaled < threshold - noise * size
        step = src.step_time_s if src.step_time_s > 0 else params.default_step_time_s
        short = too_short(
            tokens,
            remaining,
            np.full(len(reqs), float(src.bytes_per_token)),
            np.full(len(reqs), step),
            params,
        )
        # Verdicts as codes into _VERDICTS, filled from the lowest priority
        # up so that the first reason in Verdict's order wins.
        code = np.where(gain, _CODE[Verdict.NOT_BEST], _CODE[Verdict.NO_GAIN])
        target_ids = [instances[t].id for t in targets.tolist()]
        for m in moves:
            if m.source == src.id:
                ri = next(i for i, r in enumerate(reqs) if r.id == m.request)
                code[ri, target_ids.index(m.target)] = _CODE[Verdict.CHOSEN]
        code[~feasible] = _CODE[Verdict.OVER_CAPACITY]
        code[short] = _CODE[Verdict.TOO_SHORT]
        dst_flight = np.array([instances[t].in_flight for t in targets.tolist()], dtype=bool)
        code[:, dst_flight] = _CODE[Verdict.IN_FLIGHT]
        if src.in_flight:
            code[:] = _CODE[Verdict.IN_FLIGHT]
        code[[r.id in src.busy for r in reqs]] = _CODE[Verdict.IN_FLIGHT]
        code[[not r.migratable for r in reqs]] = _CODE[Verdict.NOT_MIGRATABLE]
        # (s, t, r) order: the transposed matrices, flattened.
        count = len(reqs) * len(target_ids)
        out.extend(
            map(
                Candidate,
                [r.id for r in reqs] * len(target_ids),
                repeat(src.id, count),
                [t for t in target_ids for _ in reqs],
                (unscaled.T * (2.0 / n)).ravel().tolist(),
                [_VERDICTS[c] for c in code.T.ravel().tolist()],
            )
        )
    return tuple(out)


@dataclass(frozen=True, slots=True)
class TickMoves:
    """One tick's moves as row indices into the planner's arrays.

    Algorithm 1's moves first (``plan.rows`` ...), then the drain
    evacuations (``drain`` True); ``remaining`` is each moved request's
    R-hat as the planner saw it.
    """

    plan: ArrayPlan
    rows: IntArray
    sources: IntArray
    targets: IntArray
    delta_v: FloatArray
    remaining: FloatArray
    drain: BoolArray


def decide(arrays: ClusterArrays, params: PlannerParams) -> TickMoves:
    """The planner's one entry: Algorithm 1 on ``arrays``, then the drain evacuations.

    :func:`plan` (the live scheduler, ``star plan``) calls it on arrays built
    from :class:`~star.planner.Instance` values, the simulator on its own.
    """
    decided = plan_arrays(arrays, params)
    evacuated = evacuations(arrays, decided, params)
    if not evacuated:
        return TickMoves(
            decided,
            decided.rows,
            decided.sources,
            decided.targets,
            decided.delta_v,
            decided.remaining,
            np.zeros(decided.rows.size, dtype=np.bool_),
        )
    q, s, t, dv = (np.array(column) for column in zip(*evacuated, strict=True))
    return TickMoves(
        decided,
        np.concatenate((decided.rows, q.astype(decided.rows.dtype))),
        np.concatenate((decided.sources, s.astype(decided.sources.dtype))),
        np.concatenate((decided.targets, t.astype(decided.targets.dtype))),
        np.concatenate((decided.delta_v, dv.astype(np.float64))),
        np.concatenate((decided.remaining, decided.remaining_all[q])),
        np.concatenate((np.zeros(decided.rows.size, np.bool_), np.ones(q.size, np.bool_))),
    )


def plan(instances: Sequence[Instance], params: PlannerParams, *, explain: bool = False) -> Plan:
    """Decide this tick's migrations (paper Algorithm 1; docs/design.md §3).

    Phase 1, "Instance Classification (Lines 11-16)": w_i = sum_j beta_j
    L_i(tau_j); O = {i : w_i > (1+theta) w-bar}; U = {i : L_i(0) < (1+theta)
    w-bar}, and a pair (s, t) needs t != s. Phase 2, "Candidate Enumeration
    (Lines 17-23)": r in B_s with R-hat(r) > C_mig(r)/T_exec and
    max_j (L_t(tau_j) + c_r(tau_j)) <= C_mem,t. Phase 3, "Best-Feasible
    Selection (Lines 24-34)": the candidate with the most negative Delta-V,
    if Delta-V < -min_gain; then again on the traces after that move, up to
    ``max_migrations`` moves (``auto``: |O|), each instance in at most one,
    every move after the first within what the tick's transfer budget has
    left. Requests that are not migratable or in ``busy``, and
    instances ``in_flight``, never take part; a ``draining`` instance is
    never in U (a source only). ``no-migration`` mode reports the
    classification (on current loads) and never moves anything.

    After Algorithm 1, each draining instance in no move moves one request
    out (:mod:`star.planner.drain`, ``Move.reason`` "drain"); the variance
    after counts those moves too.

    ``explain=True`` also fills ``Plan.candidates`` with every (r, s, t) of
    O x U and its :class:`Verdict` (for ``star plan``); the moves are the same.
    """
    validate_params(params)
    if not instances:
        return Plan((), {}, 0.0, (), (), 0.0, 0.0)
    arrays = from_instances(instances, params)
    offsets = arrays.offsets

    def request(row: int, source: int) -> tuple[str, int]:
        r = instances[source].requests[row - int(offsets[source])]
        return r.id, int(r.tokens)

    return plan_on(
        arrays, [inst.id for inst in instances], request, params, instances if explain else None
    )


def plan_on(
    arrays: ClusterArrays,
    ids: Sequence[str],
    request: Callable[[int, int], tuple[str, int]],
    params: PlannerParams,
    explain: Sequence[Instance] | None = None,
) -> Plan:
    """:func:`plan` on arrays the caller built (the live scheduler's tick).

    ``arrays`` must be what :func:`~star.planner.arrays.from_instances` makes
    of the instances named ``ids``; ``request(row, source)`` gives the id and
    tokens of request ``row`` (of instance ``source``). ``explain``: the
    instances themselves, to list the candidates.
    """
    validate_params(params)
    if not ids:
        return Plan((), {}, 0.0, (), (), 0.0, 0.0)
    tick = decide(arrays, params)
    decided = tick.plan
    moves: list[Move] = []
    for q, s, t, dv, drain in zip(
        tick.rows.tolist(),
        tick.sources.tolist(),
        tick.targets.tolist(),
        tick.delta_v.tolist(),
        tick.drain.tolist(),
        strict=True,
    ):
        rid, tokens = request(q, s)
        reason = DRAIN if drain else BALANCE
        remaining = float(decided.remaining_all[q])
        moves.append(Move(rid, ids[s], ids[t], dv, tokens, remaining, reason))
    over, under = decided.overloaded, decided.underloaded
    candidates: tuple[Candidate, ...] = ()
    if (
        explain is not None
        and over.any()
        and under.any()
        and params.mode.kind is not ModeKind.NO_MIGRATION
    ):
        tau = grid(params)
        cap = np.array([inst.capacity_tokens for inst in explain], dtype=np.float64)
        from star.planner import kernels

        tables = kernels.prefix_tables(decided.traces, weights(params), tau, cap, over, under)[:6]
        balance = [m for m in moves if m.reason == BALANCE]
        candidates = _explain(explain, over, under, tables, params, tau, balance)
    return Plan(
        moves=tuple(moves),
        workloads=dict(zip(ids, decided.workloads.tolist(), strict=True)),
        mean_workload=decided.mean_workload,
        overloaded=tuple([ids[i] for i in np.flatnonzero(over).tolist()]),
        underloaded=tuple([ids[i] for i in np.flatnonzero(under).tolist()]),
        variance_before=decided.variance_before,
        variance_after=decided.variance_after + sum(tick.delta_v[tick.drain].tolist()),
        candidates=candidates,
    )
