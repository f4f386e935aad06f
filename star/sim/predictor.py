"""Length-predictor models for the simulator (paper §4.3, Fig. 7; §5.3; Table 5).

The simulator does not run the MLP; it draws what one would answer.
``oracle`` answers the true remaining length; ``noisy`` blends it in log
space with the workload's median remaining length m(g) after g generated
tokens, plus an Ornstein-Uhlenbeck error in g::

    ln R-hat = (1 - w(g)) ln R + w(g) ln m(g) + s(g) z(g)

W0 and LAMBDA_TOKENS are fitted to the paper's Fig. 7 MAEs, checked by
tests/sim/test_predictor.py. A prediction every k steps costs
``PREDICT_LATENCY_S / k`` per iteration. Derivation: docs/simulator.md.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from star.sim.workload import MAX_OUTPUT_TOKENS

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]

W0 = 0.3105
LAMBDA_TOKENS = 19_037.0
S0 = 0.5
S_MIN = 0.05
CORRELATION_TOKENS = 1_000.0
PREDICT_LATENCY_S = 1.40e-3

# The prior m(g) is tabulated every this many generated tokens.
PRIOR_STEP = 128


class PriorMedian:
    """m(g): median remaining length among the workload's outputs longer than g."""

    def __init__(self, outputs: npt.ArrayLike, max_output: int = MAX_OUTPUT_TOKENS) -> None:
        out = np.sort(np.asarray(outputs, dtype=np.float64))
        grid = np.arange(0, max_output + PRIOR_STEP, PRIOR_STEP, dtype=np.float64)
        table = np.ones_like(grid)
        for i, g in enumerate(grid):
            lo = int(np.searchsorted(out, g, side="right"))
            if lo < out.size:
                table[i] = max(1.0, float(np.median(out[lo:])) - g)
        self._table = table

    @property
    def table(self) -> FloatArray:
        """m(g) at g = 0, 128, 256, ... tokens."""
        return self._table

    def __call__(self, generated: npt.ArrayLike) -> FloatArray:
        g = np.asarray(generated, dtype=np.float64)
        idx = np.minimum((g // PRIOR_STEP).astype(np.int64), self._table.size - 1)
        out: FloatArray = self._table[idx]
        return out


def noisy_estimate(
    true_remaining: npt.ArrayLike,
    generated: npt.ArrayLike,
    z: npt.ArrayLike,
    prior: PriorMedian,
    max_output: int = MAX_OUTPUT_TOKENS,
) -> FloatArray:
    """R-hat of the noisy model for requests at ``generated`` tokens with noise ``z``.

    Computed request by request in :func:`star.sim.kernels.noisy_estimate`.
    """
    from star.sim import kernels  # numba: imported by the runs that use it, not the CLI

    r = np.ascontiguousarray(true_remaining, dtype=np.float64).reshape(-1)
    g = np.ascontiguousarray(generated, dtype=np.float64).reshape(-1)
    zz = np.ascontiguousarray(z, dtype=np.float64).reshape(-1)
    out: FloatArray = kernels.noisy_estimate(
        r, g, zz, prior.table, float(PRIOR_STEP), W0, LAMBDA_TOKENS, S0, S_MIN, float(max_output)
    )
    return out


class NoiseState:
    """Per-request z(g) of the noisy model, advanced lazily and vectorised.

    ``z`` and ``at`` (the g where z was last drawn) live in arrays indexed
    by request; :meth:`advance` moves a set of requests to new g values with
    the exact OU transition, so querying at any times gives draws from the
    same process.
    """

    def __init__(self, size: int, rng: np.random.Generator) -> None:
        self._rng = rng
        self.z: FloatArray = rng.standard_normal(size)
        self.at: IntArray = np.zeros(size, dtype=np.int64)

    def draw(self, count: int) -> FloatArray:
        """``count`` standard normals from this state's generator (the fused
        kernel :func:`star.sim.kernels.predict` advances z with them)."""
        out: FloatArray = self._rng.standard_normal(count)
        return out

    def advance(self, idx: IntArray, generated: IntArray) -> FloatArray:
        """z at ``generated`` for requests ``idx`` (g never moves backwards)."""
        gap = generated - self.at[idx]
        moved = gap > 0
        if moved.any():
            which = idx[moved]
            rho = np.exp(-gap[moved] / CORRELATION_TOKENS)
            eps = self._rng.standard_normal(which.size)
            self.z[which] = rho * self.z[which] + np.sqrt(1.0 - rho * rho) * eps
            self.at[which] = generated[moved]
        out: FloatArray = self.z[idx]
        return out


def prediction_points(generated: IntArray, every: int) -> IntArray:
    """g at the last prediction: predictions run at g = 0 (the prompt) and every k steps."""
    out: IntArray = (generated // every) * every
    return out
