"""Compiled inner loops of the planner (numba, ``cache=True``).

:func:`star.planner.arrays.plan_arrays` does the classification and the
bookkeeping in numpy; the two loops that would otherwise cost one numpy call
per small step run here: building the per-instance traces from flat request
arrays, and the candidate search of paper Algorithm 1, Phases 2 and 3 (lines
17-34), on O(1) Delta-V values from prefix tables (see
:mod:`star.planner.arrays` for the algebra).

The kernels are compiled on first use and cached on disk next to this file
(``__pycache__``); :func:`warm` compiles or loads them up front so that a
process (the scheduler before it reports READY, a simulator run before its
clock starts) never pays for it on the hot path.
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Callable
from typing import Any, TypeVar, cast

import numba
import numpy as np
import numpy.typing as npt

F = TypeVar("F", bound=Callable[..., Any])


def jit(fn: F) -> F:
    """``numba.njit(cache=True)``, typed for mypy: compiled on first call, cached on disk."""
    return cast(F, numba.njit(cache=True)(fn))


FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.intp]
BoolArray = npt.NDArray[np.bool_]


@jit
def cutoffs(remaining: FloatArray, tau: FloatArray) -> IntArray:  # pragma: no cover - compiled
    """k_r = #{j : tau_j < R-hat(r)} for each request (R-hat may be inf)."""
    points = tau.size
    out = np.empty(remaining.size, dtype=np.intp)
    step = tau[1] if points > 1 else 1.0
    for q in range(remaining.size):
        rem = remaining[q]
        if rem == np.inf:
            out[q] = points
            continue
        kq = int(min(float(points), max(0.0, np.ceil(rem / step))))
        while kq < points and tau[kq] < rem:
            kq += 1
        while kq > 0 and tau[kq - 1] >= rem:
            kq -= 1
        out[q] = kq
    return out


@jit
def fill_traces(
    offsets: IntArray,
    tokens: FloatArray,
    k: IntArray,
    tau: FloatArray,
    need: BoolArray,
    out: FloatArray,
) -> None:  # pragma: no cover - compiled
    """out[i, j] = sum over requests r of instance i with j < k_r of N(r) + tau_j.

    Rows with ``need[i]`` false are left as they are (the workers' own
    traces). O(R + nH): requests are bucketed by cut-off, then suffix sums.
    """
    n = offsets.size - 1
    points = tau.size
    sum_n = np.zeros(points + 1)
    count = np.zeros(points + 1)
    for i in range(n):
        if not need[i]:
            continue
        sum_n[:] = 0.0
        count[:] = 0.0
        for q in range(offsets[i], offsets[i + 1]):
            sum_n[k[q]] += tokens[q]
            count[k[q]] += 1.0
        acc_n = 0.0
        acc_c = 0.0
        for j in range(points - 1, -1, -1):
            # Point j gets the requests with k_r >= j + 1.
            acc_n += sum_n[j + 1]
            acc_c += count[j + 1]
            out[i, j] = acc_n + acc_c * tau[j]


@jit
def weighted_variance(traces: FloatArray, beta: FloatArray) -> float:  # pragma: no cover
    """V = sum_j beta_j Var_i L_i(tau_j), population variance over instances."""
    n, points = traces.shape
    if n == 0:
        return 0.0
    # Row by row (the contiguous axis): means, then squared deviations.
    mean = np.zeros(points)
    for i in range(n):
        for j in range(points):
            mean[j] += traces[i, j]
    mean /= n
    acc = np.zeros(points)
    for i in range(n):
        for j in range(points):
            d = traces[i, j] - mean[j]
            acc[j] += d * d
    total = 0.0
    for j in range(points):
        total += beta[j] * acc[j]
    return float(total / n)


@jit
def variance_after(
    traces: FloatArray,
    beta: FloatArray,
    tau: FloatArray,
    rows: IntArray,
    owners: IntArray,
    picked: IntArray,
    remaining: FloatArray,
    tokens: FloatArray,
) -> float:  # pragma: no cover - compiled
    """:func:`weighted_variance` of ``traces`` after the moves (row ``rows[m]``
    from ``owners[m]`` to ``picked[m]``, every instance in one move at most):
    each request leaves N + tau_j at the points j its R-hat outlives."""
    after = traces.copy()
    for m in range(rows.size):
        q = rows[m]
        for j in range(tau.size):
            if tau[j] < remaining[q]:
                after[owners[m], j] -= tokens[q] + tau[j]
    for m in range(rows.size):
        q = rows[m]
        for j in range(tau.size):
            if tau[j] < remaining[q]:
                after[picked[m], j] += tokens[q] + tau[j]
    return weighted_variance(after, beta)


@jit
def prefix_tables(
    traces: FloatArray,
    beta: FloatArray,
    tau: FloatArray,
    capacity: FloatArray,
    sources: BoolArray,
    targets: BoolArray,
) -> tuple[
    FloatArray, FloatArray, FloatArray, FloatArray, FloatArray, FloatArray, FloatArray, FloatArray
]:  # pragma: no cover - compiled
    """The prefix tables every Delta-V of a tick is read from (docs/plan-state.md).

    Over the cut-off k = 0..H + 1: b0, b1, b2 = sum_{j<k} beta_j (1, tau_j,
    tau_j^2); per instance among ``sources`` or ``targets``, x and y = sum_{j<k}
    beta_j L_i(tau_j) (1, tau_j); per target, slack = the largest N a request
    with cut-off k may have to fit (-inf: none); x_min, y_min = the least x and
    y over the targets (the search's lower bound).
    """
    n, points = traces.shape
    width = points + 1
    b0 = np.zeros(width)
    b1 = np.zeros(width)
    b2 = np.zeros(width)
    for j in range(points):
        b0[j + 1] = b0[j] + beta[j]
        b1[j + 1] = b1[j] + beta[j] * tau[j]
        b2[j + 1] = b2[j] + beta[j] * tau[j] * tau[j]
    x = np.zeros((n, width))
    y = np.zeros((n, width))
    slack = np.full((n, width), -np.inf)
    x_min = np.full(width, np.inf)
    y_min = np.full(width, np.inf)
    for i in range(n):
        if not (sources[i] or targets[i]):
            continue
        for j in range(points):
            bl = traces[i, j] * beta[j]
            x[i, j + 1] = x[i, j] + bl
            y[i, j + 1] = y[i, j] + bl * tau[j]
        if not targets[i]:
            continue
        # max_j (L_t + c) <= C splits at the cut-off k: for j < k the request
        # adds N + tau_j, so N <= C - max_{j<k}(L_t + tau_j); for j >= k it
        # adds nothing, but L_t itself must stay within C.
        cap = capacity[i]
        tail = -np.inf
        ok = np.empty(width, dtype=np.bool_)
        ok[points] = True
        for j in range(points - 1, -1, -1):
            tail = max(tail, traces[i, j])
            ok[j] = tail <= cap
        head = -np.inf
        for kk in range(width):
            if kk > 0:
                head = max(head, traces[i, kk - 1] + tau[kk - 1])
            if ok[kk]:
                slack[i, kk] = cap - head
        for kk in range(width):
            x_min[kk] = min(x_min[kk], x[i, kk])
            y_min[kk] = min(y_min[kk], y[i, kk])
    return b0, b1, b2, x, y, slack, x_min, y_min


@jit
def outlasts_move(
    remaining: FloatArray | float,
    tokens: FloatArray | float,
    bytes_per_token: FloatArray | float,
    step: FloatArray | float,
    bandwidth: float,
    latency: float,
) -> BoolArray | bool:  # pragma: no cover - compiled
    """Algorithm 1 line 20: R-hat(r) > C_mig(r) / T_exec, the migration cost C_mig(r) =
    KV bytes of r / bandwidth + the fixed handoff latency. Scalars or arrays alike."""
    return remaining > (tokens * bytes_per_token / bandwidth + latency) / step


@jit
def own_value(
    tok: float,
    kq: int,
    s: int,
    b0: FloatArray,
    b1: FloatArray,
    b2: FloatArray,
    x: FloatArray,
    y: FloatArray,
) -> float:  # pragma: no cover - compiled
    """a_r: the part of (n/2) Delta-V of moving r (N = ``tok``, cut-off ``kq``) off ``s``
    that does not depend on the target."""
    return tok * tok * b0[kq] + 2.0 * tok * b1[kq] + b2[kq] - tok * x[s, kq] - y[s, kq]  # type: ignore[no-any-return]


@jit
def target_value(
    a: float, tok: float, kq: int, t: int, x: FloatArray, y: FloatArray
) -> float:  # pragma: no cover
    """(n/2) Delta-V of the move onto ``t``: a_r + N X_t[k] + Y_t[k]."""
    return a + tok * x[t, kq] + y[t, kq]  # type: ignore[no-any-return]


@jit
def term_size(
    tok: float,
    kq: int,
    s: int,
    t: int,
    b0: FloatArray,
    b1: FloatArray,
    b2: FloatArray,
    x: FloatArray,
    y: FloatArray,
) -> float:  # pragma: no cover - compiled
    """sum_{j<k} beta_j c_j (c_j + L_s + L_t): the size of a candidate's terms, which the
    rounding noise of its Delta-V scales with."""
    size = tok * tok * b0[kq] + 2.0 * tok * b1[kq] + b2[kq] + tok * x[s, kq] + y[s, kq]
    return size + (tok * x[t, kq] + y[t, kq])  # type: ignore[no-any-return]


@jit
def candidate_values(
    tokens: FloatArray,
    k: IntArray,
    s: int,
    targets: IntArray,
    tables: tuple[FloatArray, FloatArray, FloatArray, FloatArray, FloatArray, FloatArray],
) -> tuple[FloatArray, BoolArray, FloatArray]:  # pragma: no cover - compiled
    """For each request of source ``s`` (``tokens``, cut-offs ``k``) x ``targets``: its
    (n/2) Delta-V, whether it fits (and t != s), and its term size; ``tables`` are
    :func:`prefix_tables`' b0, b1, b2, x, y, slack. What ``star plan --explain`` lists,
    from the same functions the search uses."""
    b0, b1, b2, x, y, slack = tables
    values = np.empty((tokens.size, targets.size))
    fits = np.empty((tokens.size, targets.size), dtype=np.bool_)
    sizes = np.empty((tokens.size, targets.size))
    for i in range(tokens.size):
        tok = tokens[i]
        kq = k[i]
        a = own_value(tok, kq, s, b0, b1, b2, x, y)
        for j in range(targets.size):
            t = targets[j]
            values[i, j] = target_value(a, tok, kq, t, x, y)
            fits[i, j] = t != s and tok <= slack[t, kq]
            sizes[i, j] = term_size(tok, kq, s, t, b0, b1, b2, x, y)
    return values, fits, sizes


@jit
def _best_target(
    s: int,
    tok: float,
    kq: int,
    a: float,
    dst: IntArray,
    free: BoolArray,
    slack: FloatArray,
    x: FloatArray,
    y: FloatArray,
) -> tuple[float, int]:  # pragma: no cover - compiled
    """The least (n/2) Delta-V of one request over the free targets it fits on, and that target.

    Ties go to the smallest target; (inf, -1) when it fits on none.
    """
    best = np.inf
    best_t = -1
    for t in dst:
        if t == s or not free[t] or not tok <= slack[t, kq]:
            continue
        v = target_value(a, tok, kq, t, x, y)
        if v < best:
            best = v
            best_t = t
    return best, best_t


@jit
def select(
    traces: FloatArray,
    beta: FloatArray,
    tau: FloatArray,
    capacity: FloatArray,
    sources: BoolArray,
    targets: BoolArray,
    offsets: IntArray,
    tokens: FloatArray,
    remaining: FloatArray,
    k: IntArray,
    eligible: BoolArray,
    bytes_per_token: FloatArray,
    step_time: FloatArray,
    bandwidth: float,
    latency: float,
    threshold: float,
    noise: float,
    max_moves: int,
    budget: float,
) -> tuple[IntArray, IntArray, FloatArray]:  # pragma: no cover - compiled
    """Up to ``max_moves`` (row, target, (n/2) Delta-V) picks, in the order chosen.

    Candidates are requests of ``sources`` that are ``eligible`` and outlast
    their migration (Algorithm 1 line 20), against ``targets`` they fit on
    over the horizon (line 21). Each pick is the least value below
    ``threshold``; ties go to the smallest (row, target), rows being in
    (instance, request) order. A pick whose value is within ``noise`` times
    its own term size of the threshold ends the search (rounding noise).
    After a pick its source and target take part in nothing else, and every
    later pick must move at most the ``budget`` bytes (KV) the earlier ones
    left (the first is always allowed; inf: no budget).

    Greedy with lazy evaluation: a_r + N min_t X_t[k] + min_t Y_t[k] is a
    lower bound of every value of r (computed with the same operations, so
    rounding keeps it a bound); requests are evaluated (their best free
    target) in order of it, only while the bound could beat the best value
    found, and kept in a heap keyed (value, row, target). A move changes only
    its own two instances' traces and takes both out of the tick, so every
    other value stays exact; a kept value whose target has been taken is
    re-evaluated when it reaches the top (it can only grow). So the picks
    are exactly those of repeating the full enumeration after each move.
    """
    b0, b1, b2, x, y, slack, x_min, y_min = prefix_tables(
        traces, beta, tau, capacity, sources, targets
    )
    n = traces.shape[0]
    total = tokens.size
    cand = np.empty(total, dtype=np.intp)
    own = np.empty(total)
    bound = np.empty(total)
    owner = np.empty(total, dtype=np.intp)
    m = 0
    for s in range(n):
        if not sources[s]:
            continue
        for q in range(offsets[s], offsets[s + 1]):
            if not eligible[q]:
                continue
            tok = tokens[q]
            if not outlasts_move(
                remaining[q], tok, bytes_per_token[s], step_time[s], bandwidth, latency
            ):
                continue
            kq = k[q]
            a = own_value(tok, kq, s, b0, b1, b2, x, y)
            low = a + tok * x_min[kq] + y_min[kq]
            if low < threshold:
                cand[m] = q
                own[m] = a
                bound[m] = low
                owner[m] = s
                m += 1
    order = np.argsort(bound[:m])
    dst = np.flatnonzero(targets)
    free = np.ones(n, dtype=np.bool_)
    most = min(max_moves, n // 2)  # a move takes two instances out of the tick
    rows = np.full(most, -1, dtype=np.intp)
    picked = np.full(most, -1, dtype=np.intp)
    values = np.zeros(most)
    heap = [(0.0, 0, 0, 0)]  # (value, row, target, candidate); typed by this entry
    heap.pop()
    nxt = 0  # candidates order[:nxt] have been evaluated (or dropped)
    done = 0
    left = budget
    while done < most:
        # Evaluate every request whose bound does not exceed the best value kept.
        while nxt < m:
            c = order[nxt]
            if heap and heap[0][0] < bound[c]:
                break
            nxt += 1
            s = owner[c]
            q = cand[c]
            if not free[s] or (done > 0 and tokens[q] * bytes_per_token[s] > left):
                continue
            v, t = _best_target(s, tokens[q], k[q], own[c], dst, free, slack, x, y)
            if t >= 0 and v < threshold:
                heapq.heappush(heap, (v, q, t, c))
        if not heap:
            break
        v, q, t, c = heapq.heappop(heap)
        s = owner[c]
        if not free[s] or (done > 0 and tokens[q] * bytes_per_token[s] > left):
            continue  # its source moved a request already; or over the budget left
        if not free[t]:
            v, t = _best_target(s, tokens[q], k[q], own[c], dst, free, slack, x, y)
            if t >= 0 and v < threshold:
                heapq.heappush(heap, (v, q, t, c))
            continue
        tok = tokens[q]
        if not v < threshold - noise * term_size(tok, k[q], s, t, b0, b1, b2, x, y):
            break  # the best is noise, and so is everything above it
        rows[done] = q
        picked[done] = t
        values[done] = v
        done += 1
        free[s] = False
        free[t] = False
        left -= tok * bytes_per_token[s]
    return rows[:done], picked[:done], values[:done]


def warm() -> float:
    """Compile (or load from the on-disk cache) every kernel; returns the seconds it took."""
    start = time.perf_counter()
    tau = np.array([0.0, 32.0])
    beta = np.array([0.6, 0.4])
    offsets = np.array([0, 2, 2], dtype=np.intp)
    tokens = np.array([100.0, 50.0])
    remaining = np.array([np.inf, 40.0])
    k = cutoffs(remaining, tau)
    traces = np.zeros((2, 2))
    fill_traces(offsets, tokens, k, tau, np.ones(2, dtype=np.bool_), traces)
    weighted_variance(traces, beta)
    one = np.zeros(1, dtype=np.intp)
    variance_after(traces, beta, tau, one, one, one + 1, remaining, tokens)
    select(
        traces,
        beta,
        tau,
        np.full(2, 1e6),
        np.array([True, False]),
        np.array([False, True]),
        offsets,
        tokens,
        remaining,
        k,
        np.ones(2, dtype=np.bool_),
        np.zeros(2),
        np.full(2, 0.02),
        1e9,
        0.0,
        -0.0,
        1e-12,
        1,
        np.inf,
    )
    one_f = np.ones(1)
    outlasts_move(one_f, one_f, one_f, one_f, 1e9, 0.0)  # --explain's arrays
    outlasts_move(one_f, one_f, np.asarray(1.0), np.asarray(0.02), 1e9, 0.0)  # drain's
    tables = prefix_tables(
        traces, beta, tau, np.full(2, 1e6), np.ones(2, np.bool_), np.ones(2, np.bool_)
    )
    candidate_values(tokens, k, 0, np.array([1], dtype=np.intp), tables[:6])
    return time.perf_counter() - start
