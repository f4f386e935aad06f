"""Future token-load traces: the grid, the weights, R-hat per mode (paper §5.2, docs/design.md §3).

Everything the planner, the naive reference and P->D dispatch share about how a
request's future is seen lives here, so the three can never disagree on it:

- the grid tau_j = j * delta decode steps, j = 0..H (H = 0 in ``current`` and
  ``no-migration``: "otherwise, it evaluates candidates based on the current
  variance", paper §5.2 Phase 3);
- the weights beta_j, geometric and normalised to 1;
- R-hat(r), the remaining length the planner believes, per :class:`Mode`;
- the trace L_i(tau_j) = sum_r c_r(tau_j) with c_r(tau) = N(r) + tau while
  tau < R-hat(r), else 0.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from itertools import chain

import numpy as np
import numpy.typing as npt

from star.planner.types import Instance, Mode, ModeKind, PlannerParams, Request

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.intp]
BoolArray = npt.NDArray[np.bool_]

# Paper §6 "Prediction Accuracy Sensitivity" (the text under Table 4): "the
# 2-bin, 4-bin, and 6-bin settings partition the remaining-length target into
# [0, 8K), [8K, 32K]; [0, 4K), [4K, 8K), [8K, 16K), [16K, 32K]; and [0, 2K),
# [2K, 4K), [4K, 6K), [6K, 8K), [8K, 16K), [16K, 32K]". K is read as 1024
# tokens (the 32K top edge is the models' 32,768-token context).
_K = 1024
BIN_EDGES: dict[int, tuple[int, ...]] = {
    2: (0, 8 * _K, 32 * _K),
    4: (0, 4 * _K, 8 * _K, 16 * _K, 32 * _K),
    6: (0, 2 * _K, 4 * _K, 6 * _K, 8 * _K, 16 * _K, 32 * _K),
}
PAPER_SCALE_TOKENS = 32 * _K
"""The length scale of :data:`BIN_EDGES` (their top edge)."""

# A running request still holds its KV now, so it must count at tau_0 = 0
# whatever a regressor says; R-hat is clamped to at least one token.
MIN_REMAINING = 1.0


def horizon_of(params: PlannerParams) -> int:
    """H the planner uses: ``params.horizon``, or 0 in ``current``/``no-migration``."""
    if params.mode.kind in (ModeKind.CURRENT, ModeKind.NO_MIGRATION):
        return 0
    return params.horizon


def grid(params: PlannerParams) -> FloatArray:
    """tau_j = j * delta for j = 0..H, in decode steps."""
    return np.arange(horizon_of(params) + 1, dtype=np.float64) * float(params.delta)


def weights(params: PlannerParams) -> FloatArray:
    """beta_j for j = 0..H: proportional to ``beta_decay ** j``, summing to 1.

    The paper's expected variance (§5.2, eq. 2) weighs the present and each
    predicted future state by "a time-dependent weighting factor that balances
    the importance of current state versus predicted future states"; with
    ``beta_decay < 1`` the present weighs most. In ``current`` and
    ``no-migration`` modes H = 0, so this is ``[1.0]``.
    """
    raw = float(params.beta_decay) ** np.arange(horizon_of(params) + 1, dtype=np.float64)
    out: FloatArray = raw / raw.sum()
    return out


def bin_edges(bins: int, scale: float = PAPER_SCALE_TOKENS) -> tuple[float, ...]:
    """The paper's ``bins``-bin edges stretched to a top edge of ``scale`` tokens.

    The paper's edges are for 32K-token answers; a served model whose answers
    are far shorter (the tiny demo model's stay under ~1,500 tokens, its
    context is 4,096) would see every request in the bottom bin with them.
    """
    if not scale > 0:
        raise ValueError(f"bins_scale_tokens must be > 0, got {scale}")
    factor = float(scale) / PAPER_SCALE_TOKENS
    return tuple(edge * factor for edge in BIN_EDGES[bins])


def bin_value(predicted: float, bins: int, scale: float = PAPER_SCALE_TOKENS) -> float:
    """Quantise a predicted remaining length to the midpoint of its Table 4 bin.

    A bin predictor answers "which bin", and the midpoint is the natural point
    estimate of a bin. Values at or past the top edge fall in the top bin (the
    paper closes it: [16K, 32K]); negative values in the bottom bin. The edges
    are :func:`bin_edges` at ``scale``.
    """
    edges = bin_edges(bins, scale)
    i = 0
    while i < len(edges) - 2 and predicted >= edges[i + 1]:
        i += 1
    return (edges[i] + edges[i + 1]) / 2.0


def _bin_values(predicted: FloatArray, bins: int, scale: float = PAPER_SCALE_TOKENS) -> FloatArray:
    edges = np.asarray(bin_edges(bins, scale), dtype=np.float64)
    mids = (edges[:-1] + edges[1:]) / 2.0
    # Inner edges only: everything below the second edge is bin 0, everything
    # at or above the last inner edge is the top bin.
    idx = np.searchsorted(edges[1:-1], predicted, side="right")
    out: FloatArray = np.where(np.isnan(predicted), np.inf, mids[idx])
    return out


def remaining_for(request: Request, mode: Mode, scale: float = PAPER_SCALE_TOKENS) -> float:
    """R-hat(r): the remaining decode length the planner assumes in ``mode``.

    - ``current`` / ``no-migration``: not used for load (H = 0, c_r = N(r));
      returns ``inf`` so that the "remaining work outlasts the migration"
      filter never rejects a request the mode knows nothing about.
    - ``predicted``: ``predicted_remaining``; ``None`` (no prediction yet; the
      worker predicts every k = 20 steps, paper §5.3) means unknown and is
      treated as in ``current``: ``inf``, i.e. the request runs past the
      horizon and may be migrated.
    - ``oracle``: ``true_remaining``. The simulator always knows it; a live
      worker knows it only for a request whose length is fixed (``ignore_eos``
      with ``max_tokens``, no stop condition). ``None`` (not known) is read as
      in ``predicted``: ``inf``, the request keeps its load through the
      horizon and stays a candidate (the scheduler warns about it).
    - ``bins:K``: ``predicted_remaining`` quantised to the midpoint of its
      paper Table 4 bin (:func:`bin_edges` at ``scale`` tokens, the params'
      ``bins_scale_tokens``; the paper's own at 32,768); ``None`` is ``inf``
      as in ``predicted``.

    Finite values are clamped to at least 1 token: a running request holds its
    KV now, so c_r(tau_0) = N(r) and L_i(0) is the current token load.
    """
    kind = mode.kind
    if kind is ModeKind.CURRENT or kind is ModeKind.NO_MIGRATION:
        return math.inf
    if kind is ModeKind.ORACLE:
        if request.true_remaining is None:
            return math.inf
        value = float(request.true_remaining)
    else:
        if request.predicted_remaining is None or math.isnan(request.predicted_remaining):
            return math.inf
        value = float(request.predicted_remaining)
        if kind is ModeKind.BINS:
            value = bin_value(value, mode.bins, scale)
    return max(value, MIN_REMAINING)


def remaining_array(
    requests: Sequence[Request], mode: Mode, scale: float = PAPER_SCALE_TOKENS
) -> FloatArray:
    """:func:`remaining_for` over many requests at once (the planner's hot path)."""
    kind = mode.kind
    if kind is ModeKind.CURRENT or kind is ModeKind.NO_MIGRATION:
        return np.full(len(requests), np.inf)
    # None becomes NaN in the conversion; NaN (not known) -> inf.
    if kind is ModeKind.ORACLE:
        true = np.array([r.true_remaining for r in requests], dtype=np.float64)
        known: FloatArray = np.where(np.isnan(true), np.inf, np.maximum(true, MIN_REMAINING))
        return known
    pred = np.array([r.predicted_remaining for r in requests], dtype=np.float64)
    if kind is ModeKind.BINS:
        pred = _bin_values(pred, mode.bins, scale)
    out: FloatArray = np.where(np.isnan(pred), np.inf, np.maximum(pred, MIN_REMAINING))
    return out


def cutoffs(remaining: FloatArray, tau: FloatArray) -> IntArray:
    """k_r = #{j : tau_j < R-hat(r)}: c_r(tau_j) = N + tau_j for j < k_r, 0 after.

    ceil(R-hat / delta) clipped to H + 1, which is exact except when the
    quotient rounds onto an integer it lies just above; one gather fixes that
    (a searchsorted is ~20x slower on this many keys).
    """
    points = tau.size
    if points == 1:
        out: IntArray = (remaining > tau[0]).astype(np.intp)
        return out
    quotient = np.ceil(remaining / tau[1])
    np.clip(quotient, 0, points, out=quotient)
    k: IntArray = quotient.astype(np.intp)
    under = tau[np.minimum(k, points - 1)] < remaining
    under &= k < points
    k += under
    return k


def contribution(tokens: float, remaining: float, tau: FloatArray) -> FloatArray:
    """c_r(tau_j) for one request (the reference's straightforward form)."""
    out: FloatArray = np.where(tau < remaining, tokens + tau, 0.0)
    return out


def too_short(
    tokens: FloatArray,
    remaining: FloatArray,
    bpt: FloatArray | float,
    step: FloatArray | float,
    params: PlannerParams,
) -> BoolArray:
    """Paper Algorithm 1 line 20: keep r only if R-hat(r) > C_mig(r) / T_exec.

    True where a request would end before its move does (``bpt``: the source's
    KV bytes per token; ``step``: its decode step time in seconds).
    """
    from star.planner.kernels import outlasts_move  # the search's own rule (numba)

    out: BoolArray = ~np.asarray(
        outlasts_move(
            np.asarray(remaining, dtype=np.float64),
            np.asarray(tokens, dtype=np.float64),
            np.asarray(bpt, dtype=np.float64),
            np.asarray(step, dtype=np.float64),
            float(params.bandwidth_bytes_per_s),
            float(params.handoff_latency_s),
        )
    )
    return out


def traces_from_arrays(
    owner: IntArray, tokens: FloatArray, k: IntArray, n: int, tau: FloatArray
) -> FloatArray:
    """L_i(tau_j) for ``n`` instances from flat per-request arrays, in O(R + nH).

    ``k`` is :func:`cutoffs` of the requests' R-hat. A request adds N + tau_j
    to every j < k_r; bucketing requests by (owner, k_r) and taking suffix
    sums over k gives all traces without touching each (request, j) pair.
    """
    points = tau.size
    width = points + 1
    # Bucket by J - k so that the suffix sums over k become prefix sums along
    # the contiguous axis (numpy's fast direction).
    flat = owner * width + (points - k)
    sum_n = np.bincount(flat, weights=tokens, minlength=n * width).reshape(n, width)
    count = np.bincount(flat, minlength=n * width).reshape(n, width)
    np.cumsum(sum_n, axis=1, out=sum_n)
    cum_c = np.cumsum(count, axis=1)
    # Point j gets the requests with k >= j + 1, i.e. bucket J - k <= J - 1 - j.
    out: FloatArray = sum_n[:, points - 1 :: -1] + cum_c[:, points - 1 :: -1] * tau
    return out


def uses_worker_trace(instance: Instance, params: PlannerParams) -> bool:
    """Whether the worker's pre-simulated trace stands in for the requests.

    Only in ``predicted`` mode (the worker simulated with its own predictions;
    in ``oracle`` or ``bins`` the planner must see other lengths) and only when
    it has exactly H + 1 points.
    """
    return (
        instance.trace is not None
        and params.mode.kind is ModeKind.PREDICTED
        and len(instance.trace) == params.horizon + 1
    )


def flatten(
    instances: Sequence[Instance],
    which: Sequence[int],
    mode: Mode,
    scale: float = PAPER_SCALE_TOKENS,
) -> tuple[IntArray, FloatArray, FloatArray, IntArray]:
    """Flat per-request arrays for ``instances[i]`` for ``i`` in ``which``.

    Returns (owner position in ``which``, N, R-hat, offsets) where the requests
    of ``instances[which[p]]`` are ``offsets[p]:offsets[p + 1]``.
    """
    groups = [instances[i].requests for i in which]
    counts = np.fromiter(map(len, groups), dtype=np.intp, count=len(groups))
    reqs = list(chain.from_iterable(groups))
    owner: IntArray = np.repeat(np.arange(len(which), dtype=np.intp), counts)
    # Via int64: numpy converts a list of ints to int64 ~1.6x faster than to float64.
    tokens = np.fromiter([r.tokens for r in reqs], np.int64, len(reqs)).astype(np.float64)
    offsets: IntArray = np.zeros(len(which) + 1, dtype=np.intp)
    np.cumsum(counts, out=offsets[1:])
    return owner, tokens, remaining_array(reqs, mode, scale), offsets


def instance_traces(instances: Sequence[Instance], params: PlannerParams) -> FloatArray:
    """L_i(tau_j) for every instance, shape (n, H + 1)."""
    tau = grid(params)
    out = np.zeros((len(instances), tau.size))
    need = [i for i, inst in enumerate(instances) if not uses_worker_trace(inst, params)]
    if need:
        owner, tokens, remaining, _ = flatten(
            instances, need, params.mode, params.bins_scale_tokens
        )
        out[need] = traces_from_arrays(owner, tokens, cutoffs(remaining, tau), len(need), tau)
    if len(need) < len(instances):
        for i, inst in enumerate(instances):
            if inst.trace is not None and uses_worker_trace(inst, params):
                out[i] = np.asarray(inst.trace, dtype=np.float64)
    return out


def weighted_variance(traces: FloatArray, beta: FloatArray) -> float:
    """V = sum_j beta_j Var_i L_i(tau_j) (population variance over instances)."""
    n = int(traces.shape[0])
    if n == 0:
        return 0.0
    dev = traces - traces.mean(axis=0)
    total: float = float(((dev * dev) @ beta).sum())
    return total / n
