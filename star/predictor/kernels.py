"""Compiled prediction round of the hidden-state tap (numba, ``cache=True``).

A round runs inside the engine's model step right after the forward pass,
when the caches hold the model, not the predictor: there each numpy call
costs several times what it costs in a loop of its own, and a round of
numpy calls (three products, their bias and ReLU, the output decoding and
the fusion's twenty vector operations) took ~300 us for 20 rows on this
project's 2-core box. Here the same work is two calls:

- :func:`mlp`: the MLP's products (BLAS ``sgemm`` through numba's ``@``), the
  bias and the ReLU in place;
- :func:`fuse_round`: the output decoding and
  :func:`star.predictor.model.fuse_step` for every row of the round in one
  loop, new requests (``at < 0``) and known ones (their fusion state at
  ``at``) alike.

``star bench predictor --engine`` measures the round in a real engine.
:func:`warm` compiles (or loads) both before the tap is installed, so no
model step pays for the compilation.
"""

from __future__ import annotations

import math
import time

import numpy as np
import numpy.typing as npt

from star.planner.kernels import jit

F32 = npt.NDArray[np.float32]
F64 = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.intp]


@jit
def mlp(
    x: F32, weights: tuple[F32, ...], biases: tuple[F32, ...]
) -> F32:  # pragma: no cover - compiled
    """Raw outputs of the MLP ``x @ W0 + b0 -> ReLU -> ... -> x @ Wn + bn`` (float32, C order)."""
    h = x
    last = len(weights) - 1
    for i in range(len(weights)):
        h = h @ weights[i]
        h += biases[i]
        if i < last:
            flat = h.reshape(-1)
            for j in range(flat.size):
                if flat[j] < 0.0:
                    flat[j] = 0.0
    return h


@jit
def fuse_round(
    raw: F32,
    log_target: bool,
    uncertainty: bool,
    scale: float,
    at: IntArray,
    first: F64,
    fresh_cap: F64,
    generated: F64,
    weight0: F64,
    total0: F64,
    cap0: F64,
    decay: float,
    power: float,
) -> tuple[F64, F64, F64, F64]:  # pragma: no cover - compiled
    """One round's fusion for every row: (weight, total, cap, served R-hat), row by row.

    ``raw`` holds the MLP's outputs (the encoded R-hat, then log b with
    ``uncertainty``), decoded here as :meth:`LengthPredictor.decode` and
    :meth:`LengthPredictor.sigma` do. Row i continues the fusion state at
    ``at[i]`` of ``weight0``/``total0``/``cap0``, or with ``at[i] < 0`` starts
    one: its weight times ``first[i]`` (the prompt row's extra weight, 1 for
    a request moved here) and its cap ``fresh_cap[i]`` (both only read for
    such rows). Then as :func:`star.predictor.model.fuse_step`; the served
    R-hat is never above what the request can still produce, nor, where an
    output overflowed, more than that.
    """
    n = raw.shape[0]
    weight = np.empty(n)
    total = np.empty(n)
    cap = np.empty(n)
    served = np.empty(n)
    for i in range(n):
        r: float = np.float64(raw[i, 0])  # float() would keep float32 in numba
        if log_target:
            r = math.expm1(r)
        r = max(r * scale, 0.0)
        if uncertainty:
            sigma = math.exp(np.float64(raw[i, 1])) * ((r + scale) if log_target else scale)
        else:
            sigma = 1.0
        w = max(sigma, 1e-6) ** -power
        g = generated[i]
        j = at[i]
        if j < 0:
            w *= first[i]
            weight[i] = w
            total[i] = w * (r + g)
            cap[i] = fresh_cap[i]
        else:
            weight[i] = w + decay * weight0[j]
            total[i] = w * (r + g) + decay * total0[j]
            cap[i] = cap0[j]
        # Never above the cap, also where the rounds say nothing (a zero or NaN
        # weight from an overflowing output): a model step must not fail here.
        final = total[i] / weight[i] if weight[i] > 0.0 else cap[i]
        if not final <= cap[i]:
            final = cap[i]
        served[i] = max(final - g, 0.0)
    return weight, total, cap, served


def warm(dim: int = 8, depth: int = 2) -> float:
    """Compile (or load from the on-disk cache) both kernels; returns the seconds it took.

    :func:`mlp` is compiled per depth (the number of layers), so pass the
    predictor's: ``len(hidden_sizes) + 1``.
    """
    start = time.perf_counter()
    x = np.ones((2, dim), dtype=np.float32)
    weights = tuple(np.full((dim, dim), 0.01, dtype=np.float32) for _ in range(depth))
    biases = tuple(np.zeros(dim, dtype=np.float32) for _ in range(depth))
    raw = mlp(x, weights, biases)
    # One signature serves every predictor: the flags are values, not types.
    fuse_round(
        raw,
        True,
        True,
        100.0,
        np.array([-1, 0], dtype=np.intp),
        np.ones(2),
        np.full(2, 10.0),
        np.zeros(2),
        np.ones(1),
        np.ones(1),
        np.ones(1),
        0.5,
        2.0,
    )
    return time.perf_counter() - start
