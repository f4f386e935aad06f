"""Compiled per-tick loops of the simulator (numba, ``cache=True``).

The scheduler tick reads every decode instance (where each is in its
current batch) and every running request (the noisy predictor's answer);
each is a handful of arithmetic per element that numpy would spend one call
per operation on. :func:`warm` compiles or loads them before a run's clock
starts (:func:`star.sim.engine.simulate` calls it).
"""

from __future__ import annotations

import math
import time

import numpy as np
import numpy.typing as npt

from star.planner import kernels as planner_kernels
from star.planner.kernels import jit

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]
# prediction_tables(): rho, sqrt(1 - rho^2), w, s, log m per point; log r per token count.
Tables = tuple[FloatArray, FloatArray, FloatArray, FloatArray, FloatArray, FloatArray]


@jit
def read_instances(
    now: float,
    t0: FloatArray,
    steps: IntArray,
    batch: IntArray,
    tbsum: IntArray,
    extra: FloatArray,
    mnext: IntArray,
    a: float,
    b: float,
) -> tuple[IntArray, FloatArray]:  # pragma: no cover - compiled
    """Iterations done by ``now`` and the token load there, per instance.

    :func:`star.sim.decode.steps_done` per instance: the largest m <= mnext
    with T(m) <= now - t0, then S + m and L + k m.
    """
    n = t0.size
    at = np.empty(n, dtype=np.int64)
    loads = np.empty(n)
    for i in range(n):
        k = float(batch[i])
        base = float(tbsum[i] + batch[i] * steps[i])
        elapsed = now - t0[i]
        done = 0
        if elapsed >= extra[i] and k > 0.0:
            qa = b * k / 2.0
            qb = a + b * base - qa
            qc = extra[i] - elapsed
            if qa > 0.0:
                root = (-qb + math.sqrt(max(0.0, qb * qb - 4.0 * qa * qc))) / (2.0 * qa)
            else:
                root = -qc / qb
            if math.isfinite(root) and root > 0.0:
                done = int(min(math.floor(root), float(mnext[i])))
        at[i] = steps[i] + done
        loads[i] = base + k * done
    return at, loads


@jit
def _estimate(
    r: float,
    g: float,
    z: float,
    prior: FloatArray,
    prior_step: float,
    w0: float,
    decay_tokens: float,
    s0: float,
    s_min: float,
    max_output: float,
) -> float:  # pragma: no cover - compiled
    r = max(r, 1.0)
    decay = math.exp(-g / decay_tokens)
    w = w0 * decay
    s = max(s_min, s0 * decay)
    m = prior[min(int(g // prior_step), prior.size - 1)]
    value = math.exp((1.0 - w) * math.log(r) + w * math.log(m) + s * z)
    return float(min(max(value, 1.0), max(1.0, max_output - g)))


@jit
def noisy_estimate(
    true_remaining: FloatArray,
    generated: FloatArray,
    z: FloatArray,
    prior: FloatArray,
    prior_step: float,
    w0: float,
    decay_tokens: float,
    s0: float,
    s_min: float,
    max_output: float,
) -> FloatArray:  # pragma: no cover - compiled
    """:func:`star.sim.predictor.noisy_estimate`, one request at a time."""
    out = np.empty(true_remaining.size)
    for q in range(true_remaining.size):
        out[q] = _estimate(
            true_remaining[q], generated[q], z[q], prior, prior_step, w0, decay_tokens, s0,
            s_min, max_output,
        )  # fmt: skip
    return out


@jit
def running_rows(
    idx: IntArray,
    batch: IntArray,
    steps: IntArray,
    tbase: IntArray,
    gbase: IntArray,
    output: IntArray,
) -> tuple[IntArray, FloatArray, IntArray, IntArray]:  # pragma: no cover - compiled
    """Owner, N, generated and true remaining of the running requests ``idx``
    (instance by instance, ``batch[i]`` each), instance i being at ``steps[i]``."""
    total = idx.size
    owner = np.empty(total, dtype=np.int64)
    tokens = np.empty(total)
    generated = np.empty(total, dtype=np.int64)
    true = np.empty(total, dtype=np.int64)
    q = 0
    for i in range(batch.size):
        at = steps[i]
        for _ in range(batch[i]):
            r = idx[q]
            owner[q] = i
            g = gbase[r] + at
            generated[q] = g
            tokens[q] = float(tbase[r] + at)
            true[q] = output[r] - g
            q += 1
    return owner, tokens, generated, true


@jit
def prediction_points(
    idx: IntArray, generated: IntArray, every: int, noise_at: IntArray
) -> tuple[IntArray, int]:  # pragma: no cover - compiled
    """g at each request's last prediction (every k steps from g = 0), and how
    many requests' noise must move forward to it (one normal draw each)."""
    points = np.empty(idx.size, dtype=np.int64)
    moved = 0
    for q in range(idx.size):
        p = (generated[q] // every) * every
        points[q] = p
        if p > noise_at[idx[q]]:
            moved += 1
    return points, moved


def predict(
    idx: IntArray,
    generated: IntArray,
    points: IntArray,
    eps: FloatArray,
    z: FloatArray,
    noise_at: IntArray,
    output: IntArray,
    correlation: float,
    prior: FloatArray,
    prior_step: float,
    w0: float,
    decay_tokens: float,
    s0: float,
    s_min: float,
    max_output: float,
) -> FloatArray:
    """R-hat of each running request now: the noisy prediction made at its last
    prediction point, minus the tokens generated since.

    :meth:`star.sim.predictor.NoiseState.advance` (the exact OU transition,
    ``eps`` one normal per request that moves, in row order) followed by
    :func:`star.sim.predictor.noisy_estimate`, fused.

    :func:`predict_tabled` without tables: every value computed as it comes.
    """
    none = np.empty(0)
    out: FloatArray = predict_tabled(
        idx, generated, points, eps, z, noise_at, output, 1, none, none, none, none, none,
        none, correlation, prior, prior_step, w0, decay_tokens, s0, s_min, max_output,
    )  # fmt: skip
    return out


@jit
def prediction_tables(
    every: int,
    max_output: int,
    correlation: float,
    prior: FloatArray,
    prior_step: float,
    w0: float,
    decay_tokens: float,
    s0: float,
    s_min: float,
) -> Tables:  # pragma: no cover - compiled
    """What :func:`predict` recomputes per request, per multiple of ``every``
    (prediction points and OU gaps both are) and per token count: the OU
    step's rho and sqrt(1 - rho^2), the estimate's w, s and log m(g), and
    log r. Each entry is computed with :func:`predict`'s own operations, so
    :func:`predict_tabled` returns the same bits."""
    points = max_output // every + 1
    rho = np.empty(points)
    keep = np.empty(points)
    w = np.empty(points)
    s = np.empty(points)
    log_m = np.empty(points)
    for j in range(points):
        gap = j * every
        rho[j] = math.exp(-gap / correlation)
        keep[j] = math.sqrt(1.0 - rho[j] * rho[j])
        g = float(gap)
        decay = math.exp(-g / decay_tokens)
        w[j] = w0 * decay
        s[j] = max(s_min, s0 * decay)
        log_m[j] = math.log(prior[min(int(g // prior_step), prior.size - 1)])
    log_r = np.empty(max_output + 1)
    log_r[0] = 0.0  # r is at least 1
    for r in range(1, max_output + 1):
        log_r[r] = math.log(float(r))
    return rho, keep, w, s, log_m, log_r


@jit
def predict_tabled(
    idx: IntArray,
    generated: IntArray,
    points: IntArray,
    eps: FloatArray,
    z: FloatArray,
    noise_at: IntArray,
    output: IntArray,
    every: int,
    rho: FloatArray,
    keep: FloatArray,
    w: FloatArray,
    s: FloatArray,
    log_m: FloatArray,
    log_r: FloatArray,
    correlation: float,
    prior: FloatArray,
    prior_step: float,
    w0: float,
    decay_tokens: float,
    s0: float,
    s_min: float,
    max_output: float,
) -> FloatArray:  # pragma: no cover - compiled
    """:func:`predict`'s R-hat, read from :func:`prediction_tables` where a point
    or gap is on them (same bits, one exp per request instead of six
    transcendental calls) and computed directly where it is not."""
    out = np.empty(idx.size)
    c = 0
    for q in range(idx.size):
        r = idx[q]
        p = points[q]
        gap = p - noise_at[r]
        if gap > 0:
            if gap % every == 0 and gap // every < rho.size:
                j = gap // every
                z[r] = rho[j] * z[r] + keep[j] * eps[c]
            else:
                f = math.exp(-gap / correlation)
                z[r] = f * z[r] + math.sqrt(1.0 - f * f) * eps[c]
            c += 1
            noise_at[r] = p
        left = output[r] - p
        j = p // every
        if p % every == 0 and j < w.size and 0 <= left < log_r.size:
            value = math.exp((1.0 - w[j]) * log_r[max(left, 1)] + w[j] * log_m[j] + s[j] * z[r])
            est = min(max(value, 1.0), max(1.0, max_output - float(p)))
        else:
            est = _estimate(
                float(left), float(p), z[r], prior, prior_step, w0, decay_tokens, s0, s_min,
                max_output,
            )  # fmt: skip
        out[q] = max(est - float(generated[q] - p), 1.0)
    return out


def warm() -> float:
    """Compile (or load) the simulator's and the planner's kernels; returns seconds taken."""
    start = time.perf_counter()
    planner_kernels.warm()
    one = np.ones(2)
    ints = np.ones(2, dtype=np.int64)
    read_instances(1.0, np.zeros(2), ints, ints, ints, np.zeros(2), ints, 0.01, 1e-7)
    noisy_estimate(one, one, one, one, 128.0, 0.3, 1e4, 0.5, 0.05, 32768.0)
    idx = np.array([0, 1], dtype=np.int64)
    running_rows(idx, ints, ints, ints, ints, ints * 10)
    points, moved = prediction_points(idx, ints * 25, 20, np.zeros(2, dtype=np.int64))
    tables = prediction_tables(20, 100, 1000.0, one, 128.0, 0.3, 1e4, 0.5, 0.05)
    predict_tabled(
        idx, ints * 25, points, np.ones(moved), np.zeros(2), np.zeros(2, dtype=np.int64),
        ints * 100, 20, *tables, 1000.0, one, 128.0, 0.3, 1e4, 0.5, 0.05, 100.0,
    )  # fmt: skip
    return time.perf_counter() - start
