"""The buckets predictor accuracy is reported in, shared by ``star predictor eval``
(:mod:`star.predictor.evaluate`) and the live tracker (:mod:`star.predictor.live`).

Kept apart from ``evaluate`` so the scheduler can use them without importing
torch.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Sequence

PROGRESS_EDGES = (0, 1, 50, 100, 200, 400)
"""Lower edges of the progress buckets (tokens already generated)."""
LENGTH_EDGES = (0, 50, 100, 200, 400, 800)
"""Lower edges of the true-final-length buckets."""


def ranges(edges: Sequence[int]) -> list[tuple[int, int | None, str]]:
    """(low, high exclusive or None for the last, label) per bucket: "0", "1-49", "400+"."""
    out: list[tuple[int, int | None, str]] = []
    for lo, hi in zip(edges, [*edges[1:], None], strict=True):
        if hi is None:
            label = f"{lo}+"
        elif hi == lo + 1:
            label = f"{lo}"
        else:
            label = f"{lo}-{hi - 1}"
        out.append((lo, hi, label))
    return out


def index(value: int, edges: Sequence[int]) -> int:
    """The bucket ``value`` falls in (values below the first edge go to the first)."""
    return max(bisect_right(edges, value) - 1, 0)
