"""Closed-form decode iterations between state changes (paper §5.2, Fig. 3).

One iteration of a continuous batch with k running requests holding L tokens
takes ``a + b * L`` seconds and adds one token to each request, so while the
batch does not change, iteration j (0-based) takes ``a + b * (L + k j)`` and
m iterations take

    T(m) = x + m a + b (m L + k m (m - 1) / 2)

where x is a one-off extra cost of the first iteration (recomputing the KV of
a request readmitted after preemption). T is a quadratic in m, so "how many
iterations are done by time t" is one square root: the simulator advances an
instance over thousands of iterations per event instead of one per event.
"""

from __future__ import annotations

import math

import numpy as np
import numpy.typing as npt

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]


def duration(m: int, load: int, batch: int, a: float, b: float, extra: float) -> float:
    """T(m): seconds for ``m`` iterations of ``batch`` requests starting at ``load`` tokens."""
    if m <= 0:
        return 0.0
    return extra + m * a + b * (m * load + batch * m * (m - 1) / 2.0)


def steps_until(
    elapsed: float, load: int, batch: int, a: float, b: float, extra: float, cap: int
) -> int:
    """The smallest m <= ``cap`` with T(m) >= ``elapsed``: the first iteration
    boundary at or after ``elapsed`` seconds (``cap`` if none comes sooner)."""
    if elapsed <= 0.0 or cap <= 0:
        return 0
    qa = b * batch / 2.0
    qb = a + b * load - qa
    qc = extra - elapsed
    if qa > 0.0:
        m = math.ceil((-qb + math.sqrt(max(0.0, qb * qb - 4.0 * qa * qc))) / (2.0 * qa))
    else:
        m = math.ceil(-qc / qb)
    m = min(max(m, 1), cap)
    # The root is exact up to rounding; settle it against T itself (duration(),
    # written out: this runs on every event that reads an instance mid-batch).
    while (
        m > 1
        and extra + (m - 1) * a + b * ((m - 1) * load + batch * (m - 1) * (m - 2) / 2.0) >= elapsed
    ):
        m -= 1
    while m < cap and extra + m * a + b * (m * load + batch * m * (m - 1) / 2.0) < elapsed:
        m += 1
    return m


def steps_done(
    elapsed: FloatArray,
    load: FloatArray,
    batch: FloatArray,
    a: float,
    b: float,
    extra: FloatArray,
    cap: FloatArray,
) -> IntArray:
    """Vectorised: the largest m <= cap with T(m) <= elapsed, per instance.

    Used for read-only snapshots; exact up to one iteration at a boundary
    that rounding puts on the wrong side.
    """
    qa = b * batch / 2.0
    qb = a + b * load - qa
    qc = extra - elapsed
    with np.errstate(divide="ignore", invalid="ignore"):
        quad = (-qb + np.sqrt(np.maximum(0.0, qb * qb - 4.0 * qa * qc))) / (2.0 * qa)
        lin = -qc / qb
    root = np.where(qa > 0.0, quad, lin)
    root = np.where(elapsed >= extra, root, 0.0)
    out: IntArray = np.clip(np.floor(np.nan_to_num(root, nan=0.0, posinf=0.0)), 0, cap).astype(
        np.int64
    )
    return out
