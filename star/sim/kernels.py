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
    last = prior.size - 1
    for q in range(true_remaining.size):
        r = max(true_remaining[q], 1.0)
        g = generated[q]
        decay = math.exp(-g / decay_tokens)
        w = w0 * decay
        s = max(s_min, s0 * decay)
        m = prior[min(int(g // prior_step), last)]
        value = math.exp((1.0 - w) * math.log(r) + w * math.log(m) + s * z[q])
        out[q] = min(max(value, 1.0), max(1.0, max_output - g))
    return out


def warm() -> float:
    """Compile (or load) the simulator's and the planner's kernels; returns seconds taken."""
    start = time.perf_counter()
    planner_kernels.warm()
    one = np.ones(2)
    ints = np.ones(2, dtype=np.int64)
    read_instances(1.0, np.zeros(2), ints, ints, ints, np.zeros(2), ints, 0.01, 1e-7)
    noisy_estimate(one, one, one, one, 128.0, 0.3, 1e4, 0.5, 0.05, 32768.0)
    return time.perf_counter() - start
