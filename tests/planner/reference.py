"""A straightforward implementation of the same rule as :func:`star.planner.plan`.

This is paper Algorithm 1 as written, at the paper's "optimized" cost
O(n + |O|·|U|·R_max·H) (§5.2 "Complexity Analysis"): for every pair (s, t) of
O x U and every request r on s it builds c_r(tau_0..tau_H) and sums
Delta-V = (2/n) sum_j beta_j c_j (c_j + L_t(tau_j) - L_s(tau_j)) directly; with
``full_variance=True`` it instead recomputes V = sum_j beta_j Var_i L_i(tau_j)
of the whole cluster after the move, which is what Delta-V is meant to equal.
No prefix sums, no pruning: tests check the fast planner against it and
``star bench planner`` times the two side by side.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from star.planner.core import CLASSIFY_RTOL, noise_floor
from star.planner.trace import (
    FloatArray,
    contribution,
    grid,
    remaining_for,
    uses_worker_trace,
    weighted_variance,
    weights,
)
from star.planner.types import (
    AUTO,
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


def reference_traces(instances: Sequence[Instance], params: PlannerParams) -> FloatArray:
    """L_i(tau_j) summed request by request (or the worker's trace where the planner uses it)."""
    tau = grid(params)
    out = np.zeros((len(instances), tau.size))
    for i, inst in enumerate(instances):
        if inst.trace is not None and uses_worker_trace(inst, params):
            out[i] = np.asarray(inst.trace, dtype=np.float64)
            continue
        for r in inst.requests:
            remaining = remaining_for(r, params.mode, params.bins_scale_tokens)
            out[i] += contribution(float(r.tokens), remaining, tau)
    return out


def reference_plan(
    instances: Sequence[Instance],
    params: PlannerParams,
    *,
    explain: bool = False,
    full_variance: bool = False,
) -> Plan:
    """Plan one tick by full enumeration; same contract as :func:`star.planner.plan`.

    Several moves per tick are chosen one after another, each by a full
    enumeration on the traces the moves before it left. Ties on Delta-V go
    to the smallest (source, request, target) by position.
    Evacuation of draining instances follows Algorithm 1 as in
    :mod:`star.planner.drain`.
    """
    validate_params(params)
    n = len(instances)
    if n == 0:
        return Plan((), {}, 0.0, (), (), 0.0, 0.0)
    beta = weights(params)
    tau = grid(params)
    traces = reference_traces(instances, params)
    work = [float(beta @ traces[i]) for i in range(n)]
    mean = sum(work) / n
    bound = (1.0 + params.theta) * mean
    slack = CLASSIFY_RTOL * abs(bound)
    over = [i for i in range(n) if work[i] > bound + slack]
    under = [i for i in range(n) if traces[i][0] < bound - slack and not instances[i].draining]
    ids = [inst.id for inst in instances]
    v0 = weighted_variance(traces, beta)
    workloads = dict(zip(ids, work, strict=True))
    head = (workloads, mean, tuple(ids[i] for i in over), tuple(ids[i] for i in under))
    if params.mode.kind is ModeKind.NO_MIGRATION:
        return Plan((), *head, v0, v0)

    def too_short(inst: Instance, tokens: float, remaining: float) -> bool:
        step = inst.step_time_s if inst.step_time_s > 0 else params.default_step_time_s
        c_mig = tokens * inst.bytes_per_token / params.bandwidth_bytes_per_s
        c_mig += params.handoff_latency_s
        return not remaining > c_mig / step

    noise = noise_floor(tau.size)

    def gains(cs: FloatArray, dvs: FloatArray, s: int, t: int, now: FloatArray) -> list[bool]:
        """Delta-V < -epsilon, beyond rounding noise of the candidate's own terms."""
        size = (2.0 / n) * ((cs * (cs + now[t] + now[s])) @ beta)
        return [bool(d < -params.min_gain - noise * z) for d, z in zip(dvs, size, strict=True)]

    def delta_vs(cs: FloatArray, s: int, t: int, now: FloatArray) -> FloatArray:
        """Delta-V of moving each row of ``cs`` from s to t, given traces ``now``."""
        if not full_variance:
            out: FloatArray = (2.0 / n) * ((cs * (cs + now[t] - now[s])) @ beta)
            return out
        before = weighted_variance(now, beta)
        vals = np.empty(cs.shape[0])
        for row, c in enumerate(cs):
            moved = now.copy()
            moved[s] -= c
            moved[t] += c
            vals[row] = weighted_variance(moved, beta) - before
        return vals

    scale = params.bins_scale_tokens
    remaining = [
        [remaining_for(r, params.mode, scale) for r in inst.requests] for inst in instances
    ]
    contrib = [
        np.array(
            [
                contribution(float(r.tokens), rem, tau)
                for r, rem in zip(inst.requests, rems, strict=True)
            ]
        ).reshape(-1, tau.size)
        for inst, rems in zip(instances, remaining, strict=True)
    ]

    def eligible(s: int, ri: int) -> bool:
        inst = instances[s]
        r = inst.requests[ri]
        return (
            r.migratable
            and r.id not in inst.busy
            and not too_short(inst, float(r.tokens), remaining[s][ri])
        )

    def kv_bytes(s: int, ri: int) -> float:
        return float(instances[s].requests[ri].tokens) * instances[s].bytes_per_token

    # A greedy sequence: each move is the best of a full enumeration on the
    # traces after the moves before it, among the requests that fit in what
    # the transfer budget has left (the first move always may).
    now = traces.copy()
    used = {i for i, inst in enumerate(instances) if inst.in_flight}
    moves: list[Move] = []
    limit = len(over) if params.max_migrations == AUTO else int(params.max_migrations)
    left = params.transfer_budget_s * params.bandwidth_bytes_per_s
    if left <= 0:
        left = float("inf")
    for _ in range(limit if over and under else 0):
        best: tuple[float, int, int, int] | None = None
        best_gains = False
        for s in over:
            if s in used or not instances[s].requests:
                continue
            rows = [
                ri
                for ri in range(len(instances[s].requests))
                if eligible(s, ri) and (not moves or kv_bytes(s, ri) <= left)
            ]
            if not rows:
                continue
            cs = contrib[s][rows]
            for t in under:
                if t == s or t in used:
                    continue
                fits = (cs + now[t]).max(axis=1) <= instances[t].capacity_tokens
                dvs = delta_vs(cs, s, t, now)
                ok = gains(cs, dvs, s, t, now)
                for row, ri in enumerate(rows):
                    if fits[row]:
                        key = (float(dvs[row]), s, ri, t)
                        if best is None or key < best:
                            best, best_gains = key, ok[row]
        if best is None or not best_gains:
            break
        dv, s, ri, t = best
        c = contrib[s][ri]
        now[s] -= c
        now[t] += c
        used |= {s, t}
        left -= kv_bytes(s, ri)
        r = instances[s].requests[ri]
        moves.append(Move(r.id, ids[s], ids[t], dv, int(r.tokens), remaining[s][ri]))

    # Evacuation (star.planner.drain): each draining instance in no move moves
    # out its longest request (then the least KV) that may and is worth moving,
    # to the least loaded instance (then the first) that is not draining, in no
    # move, and has room for it.
    for s, src in enumerate(instances):
        if not src.draining or s in used:
            continue
        order = sorted(
            (r for r in range(len(src.requests)) if eligible(s, r)),
            key=lambda r: (-remaining[s][r], float(src.requests[r].tokens), r),
        )
        for ri in order:
            c = contrib[s][ri]
            room = [
                t
                for t, dst in enumerate(instances)
                if t not in used
                and not dst.draining
                and float((c + now[t]).max()) <= dst.capacity_tokens
            ]
            if not room:
                continue
            t = min(room, key=lambda t: (work[t], t))
            dv = float(delta_vs(c[None, :], s, t, now)[0])
            now[s] -= c
            now[t] += c
            used |= {s, t}
            r = src.requests[ri]
            moves.append(Move(r.id, ids[s], ids[t], dv, int(r.tokens), remaining[s][ri], DRAIN))
            break

    candidates: list[Candidate] = []
    if explain and over and under:
        chosen = {(m.request, m.source, m.target) for m in moves if m.reason != DRAIN}
        for s in over:
            src = instances[s]
            if not src.requests:
                continue
            for t in under:
                if t == s:
                    continue
                dst = instances[t]
                dvs = delta_vs(contrib[s], s, t, traces)
                ok = gains(contrib[s], dvs, s, t, traces)
                fits = (contrib[s] + traces[t]).max(axis=1) <= dst.capacity_tokens
                for ri, r in enumerate(src.requests):
                    if not r.migratable:
                        verdict = Verdict.NOT_MIGRATABLE
                    elif r.id in src.busy or src.in_flight or dst.in_flight:
                        verdict = Verdict.IN_FLIGHT
                    elif too_short(src, float(r.tokens), remaining[s][ri]):
                        verdict = Verdict.TOO_SHORT
                    elif not fits[ri]:
                        verdict = Verdict.OVER_CAPACITY
                    elif (r.id, src.id, dst.id) in chosen:
                        verdict = Verdict.CHOSEN
                    elif not ok[ri]:
                        verdict = Verdict.NO_GAIN
                    else:
                        verdict = Verdict.NOT_BEST
                    candidates.append(Candidate(r.id, src.id, dst.id, float(dvs[ri]), verdict))
    return Plan(tuple(moves), *head, v0, weighted_variance(now, beta), tuple(candidates))
