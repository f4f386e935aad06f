"""One scheduler tick of paper Algorithm 1 ("Decode Rescheduling"), sans IO.

Paper §5.2: "The scheduler periodically collects pre-simulated state reports
from all workers, classifies instances, enumerates candidates, and completes
the remaining simulation to select the best feasible migration." This module
is that tick as a pure function of the reported state (DESIGN §3 makes it
exact); the live scheduler, ``star plan`` and the simulator all call
:func:`plan`.

Speed. Moving r from s to t leaves the mean load unchanged, so

    Delta-V(r, s, t) = (2/n) sum_j beta_j c_j (c_j + L_t(tau_j) - L_s(tau_j))

and since c_j = N + tau_j for j < k_r and 0 after, with prefix sums over j of
beta, beta*tau, beta*tau^2, beta*L_i and beta*tau*L_i (index k = sum over
j < k) this is

    (n/2) Delta-V = N^2 B0[k] + 2N B1[k] + B2[k] - N X_s[k] - Y_s[k]   (a_r)
                  + N X_t[k] + Y_t[k],

O(1) per candidate. The capacity filter max_j (L_t(tau_j) + c_j) <= C_t is
O(1) too, from a prefix max of L_t + tau and a suffix max of L_t. The search
over |O|·|U|·R candidates is then branch-and-bound: X_t, Y_t >= their minimum
over the targets, so a_r + N min_t X_t[k] + min_t Y_t[k] bounds every
Delta-V of r from below; requests are evaluated against all targets in order
of that bound, and the search stops once the next bound cannot beat the best
found. The result is exactly the full enumeration's argmin (ties included:
floating-point rounding is monotone and the bound is computed with the same
operations as the value), usually after a few dozen requests.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import repeat

import numpy as np
import numpy.typing as npt

from star.planner.trace import (
    BoolArray,
    FloatArray,
    IntArray,
    cutoffs,
    flatten,
    grid,
    remaining_array,
    traces_from_arrays,
    weighted_variance,
    weights,
)
from star.planner.types import (
    Candidate,
    Instance,
    ModeKind,
    Move,
    Plan,
    PlannerParams,
    Verdict,
)

# Delta-V is a difference of sums that can cancel exactly: moving the only
# request of s onto an empty t just swaps the two traces (Delta-V = 0), and
# rounding may then show a "gain" of -1e-9 that would migrate back and forth
# forever. A gain no larger than this many ulps of the candidate's own term
# magnitude, sum_j beta_j c_j (c_j + L_s + L_t), counts as no gain.
_NOISE_ULPS = 8.0


def noise_floor(points: int) -> float:
    """Relative size below which a Delta-V is rounding noise (H + 1 = ``points``)."""
    return _NOISE_ULPS * (points + 16) * float(np.finfo(np.float64).eps)


# Classification compares w_i with (1+theta) times a mean of the w_i; with
# theta = 0 and identical instances the rounding of the mean alone would call
# them all overloaded. Comparisons are made this much (relative) past the bound.
CLASSIFY_RTOL = 1e-12

_VERDICTS = tuple(Verdict)
_CODE = {v: i for i, v in enumerate(_VERDICTS)}

# First batch of requests evaluated against every target; later batches grow
# 4x so that a search that does not stop early costs O(log) numpy calls.
_FIRST_BATCH = 32


def validate_params(params: PlannerParams) -> None:
    """Raise ValueError, quoting the bad value, for parameters Algorithm 1 cannot use."""

    def bad(name: str, value: object, why: str) -> ValueError:
        return ValueError(f"planner parameter {name}={value!r}: {why}")

    if not isinstance(params.horizon, int) or params.horizon < 0:
        raise bad("horizon", params.horizon, "must be an integer >= 0")
    if not isinstance(params.delta, int) or params.delta < 1:
        raise bad("delta", params.delta, "must be an integer >= 1 (decode steps)")
    if not isinstance(params.max_migrations, int) or params.max_migrations < 0:
        raise bad("max_migrations", params.max_migrations, "must be an integer >= 0")
    if not (math.isfinite(params.beta_decay) and params.beta_decay > 0):
        raise bad("beta_decay", params.beta_decay, "must be a finite number > 0")
    for name in ("theta", "min_gain", "handoff_latency_s"):
        value = getattr(params, name)
        if not (math.isfinite(value) and value >= 0):
            raise bad(name, value, "must be a finite number >= 0")
    for name in ("bandwidth_bytes_per_s", "default_step_time_s"):
        value = getattr(params, name)
        if not (math.isfinite(value) and value > 0):
            raise bad(name, value, "must be a finite number > 0")


@dataclass(slots=True)
class _Prefix:
    """Per-instance prefix tables over the cut-off k = 0..H + 1."""

    b0: FloatArray  # sum_{j<k} beta_j
    b1: FloatArray  # sum_{j<k} beta_j tau_j
    b2: FloatArray  # sum_{j<k} beta_j tau_j^2
    x: FloatArray  # (i, k): sum_{j<k} beta_j L_i(tau_j)
    y: FloatArray  # (i, k): sum_{j<k} beta_j tau_j L_i(tau_j)
    slack: FloatArray  # (i, k): largest N a request with cut-off k may have to fit on i

    @classmethod
    def build(
        cls, traces: FloatArray, beta: FloatArray, tau: FloatArray, cap: FloatArray
    ) -> _Prefix:
        """Tables from traces of shape (n, H + 1) and capacities of shape (n,)."""
        n, points = traces.shape

        def prefix(v: FloatArray) -> FloatArray:
            # Along the last, contiguous axis: numpy's cumsum is ~3x slower
            # across rows.
            out = np.zeros((*v.shape[:-1], points + 1))
            np.cumsum(v, axis=-1, out=out[..., 1:])
            return out

        bl = traces * beta
        # max_j (L_t + c) <= C splits at the cut-off k: for j < k the request
        # adds N + tau_j, so N <= C - max_{j<k}(L_t + tau_j); for j >= k it
        # adds nothing, but L_t itself must stay within C.
        head = np.empty((n, points + 1))
        head[:, 0] = -np.inf
        np.maximum.accumulate(traces + tau, axis=1, out=head[:, 1:])
        tail = np.empty((n, points + 1))
        tail[:, points] = -np.inf
        np.maximum.accumulate(traces[:, ::-1], axis=1, out=tail[:, points - 1 :: -1])
        capc = cap[:, None]
        slack = capc - head
        slack[tail > capc] = -np.inf
        return cls(
            b0=prefix(beta),
            b1=prefix(beta * tau),
            b2=prefix(beta * tau * tau),
            x=prefix(bl),
            y=prefix(bl * tau),
            slack=slack,
        )

    def own(self, tokens: FloatArray, k: IntArray, source: IntArray) -> FloatArray:
        """a_r: the part of (n/2) Delta-V that does not depend on the target."""
        out: FloatArray = (
            tokens * tokens * self.b0[k]
            + 2.0 * tokens * self.b1[k]
            + self.b2[k]
            - tokens * self.x[source, k]
            - self.y[source, k]
        )
        return out

    def own_magnitude(self, tokens: FloatArray, k: IntArray, source: IntArray) -> FloatArray:
        """sum_{j<k} beta_j c_j (c_j + L_s): the source's share of a candidate's term size."""
        out: FloatArray = (
            tokens * tokens * self.b0[k]
            + 2.0 * tokens * self.b1[k]
            + self.b2[k]
            + tokens * self.x[source, k]
            + self.y[source, k]
        )
        return out

    def raw(
        self, own: FloatArray, tokens: FloatArray, k: IntArray, source: IntArray, targets: IntArray
    ) -> tuple[FloatArray, BoolArray]:
        """(n/2) Delta-V and capacity feasibility for each request x target.

        Summed in the same order as the search's lower bound, which keeps the
        bound <= the value after rounding.
        """
        rows = k[:, None]
        cols = targets[None, :]
        tok = tokens[:, None]
        vals: FloatArray = own[:, None] + tok * self.x[cols, rows] + self.y[cols, rows]
        feasible: BoolArray = (tok <= self.slack[cols, rows]) & (cols != source[:, None])
        return vals, feasible

    def values(
        self, own: FloatArray, tokens: FloatArray, k: IntArray, source: IntArray, targets: IntArray
    ) -> FloatArray:
        """(n/2) Delta-V for each request x target, +inf where infeasible."""
        vals, feasible = self.raw(own, tokens, k, source, targets)
        out: FloatArray = np.where(feasible, vals, np.inf)
        return out


@dataclass(slots=True)
class _Pool:
    """Candidate requests on the eligible sources, in (source, request) order.

    Whether a request is migratable and not busy is only looked up for the few
    requests the search actually evaluates (``known``: -1 not yet, 0/1 after),
    which keeps the per-request Python work off the hot path.
    """

    source: IntArray  # instance index
    index: IntArray  # position in that instance's requests
    tokens: FloatArray
    remaining: FloatArray
    k: IntArray
    known: npt.NDArray[np.int8]

    def eligible(self, instances: Sequence[Instance], batch: IntArray) -> BoolArray:
        out = np.empty(batch.size, dtype=bool)
        known = self.known
        for j, q in enumerate(batch.tolist()):
            v = int(known[q])
            if v < 0:
                inst = instances[int(self.source[q])]
                r = inst.requests[int(self.index[q])]
                v = int(r.migratable and r.id not in inst.busy)
                known[q] = v
            out[j] = v > 0
        return out


def _too_short(
    tokens: FloatArray,
    remaining: FloatArray,
    bpt: FloatArray,
    step: FloatArray,
    params: PlannerParams,
) -> BoolArray:
    """Paper Algorithm 1 line 20: keep r only if R-hat(r) > C_mig(r) / T_exec."""
    c_mig = tokens * bpt / params.bandwidth_bytes_per_s + params.handoff_latency_s
    out: BoolArray = ~(remaining > c_mig / step)
    return out


def _step_times(instances: Sequence[Instance], which: IntArray, default: float) -> FloatArray:
    return np.array(
        [instances[i].step_time_s if instances[i].step_time_s > 0 else default for i in which],
        dtype=np.float64,
    )


_Flat = tuple[IntArray, FloatArray, FloatArray, IntArray, IntArray]


def _pool(
    instances: Sequence[Instance],
    sources: IntArray,
    params: PlannerParams,
    tau: FloatArray,
    flat: _Flat | None,
) -> _Pool:
    """The sources' requests that pass the too-short filter."""
    counts = np.array([len(instances[s].requests) for s in sources], dtype=np.intp)
    total = int(counts.sum())
    before = np.cumsum(counts) - counts
    if flat is not None and bool((flat[0][sources] >= 0).all()):
        # The traces were computed from these very requests: reuse the arrays.
        where, all_tokens, all_remaining, all_k, offsets = flat
        idx = np.repeat(offsets[where[sources]] - before, counts) + np.arange(total)
        tokens, remaining, k = all_tokens[idx], all_remaining[idx], all_k[idx]
    else:
        _, tokens, remaining, _ = flatten(instances, sources.tolist(), params.mode)
        k = cutoffs(remaining, tau)
    owner = np.repeat(np.arange(sources.size), counts)
    index = np.arange(total) - np.repeat(before, counts)
    bpt = np.array([instances[s].bytes_per_token for s in sources], dtype=np.float64)
    step = _step_times(instances, sources, params.default_step_time_s)
    keep = ~_too_short(tokens, remaining, bpt[owner], step[owner], params)
    size = int(keep.sum())
    return _Pool(
        source=sources[owner[keep]],
        index=index[keep],
        tokens=tokens[keep],
        remaining=remaining[keep],
        k=k[keep],
        known=np.full(size, -1, dtype=np.int8),
    )


def _search(
    instances: Sequence[Instance],
    pre: _Prefix,
    pool: _Pool,
    own: FloatArray,
    alive: BoolArray,
    targets: IntArray,
    threshold: float,
    n: int,
) -> tuple[float, int, int] | None:
    """Best (value, pool index, target) with value < threshold, or None.

    Ties go to the smallest (source, request, target) in instance order, the
    same rule as :mod:`star.planner.reference`.
    """
    k = pool.k
    x_min = pre.x[targets].min(axis=0)
    y_min = pre.y[targets].min(axis=0)
    bound = own + pool.tokens * x_min[k] + y_min[k]
    cand = np.flatnonzero(alive & (bound < threshold))
    if cand.size == 0:
        return None
    if cand.size > _FIRST_BATCH:
        # Usually the first batch settles it: partition first, sort only if not.
        part = np.argpartition(bound[cand], _FIRST_BATCH)
        cand = cand[part]
        head = cand[:_FIRST_BATCH]
        cand[:_FIRST_BATCH] = head[np.argsort(bound[head], kind="stable")]
    sorted_upto = min(cand.size, _FIRST_BATCH)
    best_val = threshold
    best_key = -1
    pos, size = 0, _FIRST_BATCH
    while pos < cand.size:
        if pos >= sorted_upto:
            # Only requests whose bound can still match the best need sorting
            # (the best only improves); usually none is left.
            rest = cand[pos:]
            rest = rest[bound[rest] <= best_val]
            if rest.size == 0:
                break
            cand = np.concatenate((cand[:pos], rest[np.argsort(bound[rest], kind="stable")]))
            sorted_upto = cand.size
        if bound[cand[pos]] > best_val:
            break
        batch = np.sort(cand[pos : pos + size])
        pos += size
        size *= 4
        batch = batch[pool.eligible(instances, batch)]
        if batch.size == 0:
            continue
        vals = pre.values(own[batch], pool.tokens[batch], k[batch], pool.source[batch], targets)
        low = float(vals.min())
        if low < best_val or (low == best_val and best_key >= 0):
            rows, cols = np.nonzero(vals == low)
            # Pool order is (source, request) order, so this key orders ties
            # lexicographically by (source, request, target).
            key = int((batch[rows] * n + targets[cols]).min())
            if low < best_val or key < best_key:
                best_val, best_key = low, key
    if best_key < 0:
        return None
    return best_val, best_key // n, best_key % n


def _choose(
    instances: Sequence[Instance],
    pre: _Prefix,
    pool: _Pool,
    targets: IntArray,
    params: PlannerParams,
    n: int,
) -> list[Move]:
    """Best-feasible selection (Algorithm 1 lines 24-34), up to M times."""
    if pool.tokens.size == 0:
        return []
    # Delta-V < -epsilon, in the (n/2)-scaled units the search works in.
    threshold = -params.min_gain * n / 2.0
    own = pre.own(pool.tokens, pool.k, pool.source)
    noise = noise_floor(pre.b0.size - 1)
    alive = np.ones(pool.tokens.size, dtype=bool)
    moves: list[Move] = []
    for _ in range(params.max_migrations):
        if targets.size == 0:
            break
        found = _search(instances, pre, pool, own, alive, targets, threshold, n)
        if found is None:
            break
        value, q, t = found
        k = pool.k[q : q + 1]
        size = pre.own_magnitude(pool.tokens[q : q + 1], k, pool.source[q : q + 1])[0]
        size += pool.tokens[q] * pre.x[t, k[0]] + pre.y[t, k[0]]
        if not value < threshold - noise * size:
            break  # the best is noise, and so is everything above it
        s = int(pool.source[q])
        moves.append(
            Move(
                request=instances[s].requests[int(pool.index[q])].id,
                source=instances[s].id,
                target=instances[t].id,
                delta_v=value * 2.0 / n,
                tokens=int(pool.tokens[q]),
                remaining=float(pool.remaining[q]),
            )
        )
        # One migration per instance per tick. Other pairs' Delta-V depend
        # only on their own traces, so nothing else needs recomputing.
        alive &= (pool.source != s) & (pool.source != t)
        targets = targets[(targets != s) & (targets != t)]
    return moves


def _apply(
    traces: FloatArray, moves: Sequence[Move], index: dict[str, int], tau: FloatArray
) -> None:
    for m in moves:
        c = np.where(tau < m.remaining, m.tokens + tau, 0.0)
        traces[index[m.source]] -= c
        traces[index[m.target]] += c


def _explain(
    instances: Sequence[Instance],
    over: BoolArray,
    under: BoolArray,
    pre: _Prefix,
    params: PlannerParams,
    tau: FloatArray,
    moves: Sequence[Move],
) -> tuple[Candidate, ...]:
    """Every (r, s, t) of O x U (t != s) with its Delta-V and verdict, in (s, t, r) order."""
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
        remaining = remaining_array(reqs, params.mode)
        k = cutoffs(remaining, tau)
        source = np.full(len(reqs), s)
        own = pre.own(tokens, k, source)
        unscaled, feasible = pre.raw(own, tokens, k, source, targets)
        size = pre.own_magnitude(tokens, k, source)[:, None]
        size = size + tokens[:, None] * pre.x[targets[None, :], k[:, None]]
        size += pre.y[targets[None, :], k[:, None]]
        gain = unscaled < threshold - noise * size
        step = src.step_time_s if src.step_time_s > 0 else params.default_step_time_s
        short = _too_short(
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


def plan(instances: Sequence[Instance], params: PlannerParams, *, explain: bool = False) -> Plan:
    """Decide this tick's migrations (paper Algorithm 1; DESIGN §3).

    Phase 1, "Instance Classification (Lines 11-16)": w_i = sum_j beta_j
    L_i(tau_j); O = {i : w_i > (1+theta) w-bar}; U = {i : L_i(0) < (1+theta)
    w-bar}, and a pair (s, t) needs t != s. Phase 2, "Candidate Enumeration
    (Lines 17-23)": r in B_s with R-hat(r) > C_mig(r)/T_exec and
    max_j (L_t(tau_j) + c_r(tau_j)) <= C_mem,t. Phase 3, "Best-Feasible
    Selection (Lines 24-34)": the candidate with the most negative Delta-V,
    if Delta-V < -min_gain; up to ``max_migrations`` of them, each instance in
    at most one. Requests that are not migratable or in ``busy``, and
    instances ``in_flight``, never take part. ``no-migration`` mode reports the
    classification (on current loads) and never moves anything.

    ``explain=True`` also fills ``Plan.candidates`` with every (r, s, t) of
    O x U and its :class:`Verdict` (for ``star plan``); the moves are the same.
    """
    validate_params(params)
    n = len(instances)
    if n == 0:
        return Plan((), {}, 0.0, (), (), 0.0, 0.0)
    beta = weights(params)
    tau = grid(params)

    if params.mode.kind is ModeKind.PREDICTED:
        points = tau.size
        need = [
            i for i, inst in enumerate(instances) if inst.trace is None or len(inst.trace) != points
        ]
    else:
        need = list(range(n))
    flat: _Flat | None = None
    if len(need) == n:
        owner, tokens, remaining, offsets = flatten(instances, need, params.mode)
        k = cutoffs(remaining, tau)
        traces = traces_from_arrays(owner, tokens, k, n, tau)
        flat = (np.arange(n), tokens, remaining, k, offsets)
    else:
        traces = np.zeros((n, tau.size))
        if need:
            owner, tokens, remaining, offsets = flatten(instances, need, params.mode)
            k = cutoffs(remaining, tau)
            traces[need] = traces_from_arrays(owner, tokens, k, len(need), tau)
            where = np.full(n, -1, dtype=np.intp)
            where[need] = np.arange(len(need))
            flat = (where, tokens, remaining, k, offsets)
        # The workers' own pre-simulated traces (Algorithm 1's "pre-simulated
        # state reports"): only the sources' requests need looking at.
        have = np.setdiff1d(np.arange(n), need)
        traces[have] = np.array([instances[i].trace for i in have.tolist()], dtype=np.float64)

    work = traces @ beta
    mean = float(work.mean())
    bound = (1.0 + params.theta) * mean
    slack = CLASSIFY_RTOL * abs(bound)
    over = work > bound + slack
    under = traces[:, 0] < bound - slack
    ids = [inst.id for inst in instances]
    variance = weighted_variance(traces, beta)
    workloads = dict(zip(ids, work.tolist(), strict=True))
    overloaded = tuple([ids[i] for i in np.flatnonzero(over).tolist()])
    underloaded = tuple([ids[i] for i in np.flatnonzero(under).tolist()])

    # Algorithm 1 line 6: nothing to do unless some instance is overloaded.
    if params.mode.kind is ModeKind.NO_MIGRATION or not overloaded or not underloaded:
        return Plan((), workloads, mean, overloaded, underloaded, variance, variance)

    in_flight = np.array([inst.in_flight for inst in instances], dtype=bool)
    sources = np.flatnonzero(over & ~in_flight)
    targets = np.flatnonzero(under & ~in_flight)
    cap = np.array([inst.capacity_tokens for inst in instances], dtype=np.float64)
    pre = _Prefix.build(traces, beta, tau, cap)
    moves: list[Move] = []
    if sources.size and targets.size and params.max_migrations > 0:
        pool = _pool(instances, sources, params, tau, flat)
        moves = _choose(instances, pre, pool, targets, params, n)

    after = variance
    if moves:
        _apply(traces, moves, {iid: i for i, iid in enumerate(ids)}, tau)
        after = weighted_variance(traces, beta)
    candidates = _explain(instances, over, under, pre, params, tau, moves) if explain else ()
    return Plan(
        moves=tuple(moves),
        workloads=workloads,
        mean_workload=mean,
        overloaded=overloaded,
        underloaded=underloaded,
        variance_before=variance,
        variance_after=after,
        candidates=candidates,
    )
