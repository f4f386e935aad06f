"""FusionBook (the tap's per-request fusion state, in arrays) against fuse_step, request by request."""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest

from star.predictor.fusion import FusionBook
from star.predictor.model import fuse_step

DECAY, POWER, FIRST = 0.5, 2.0, 4.0
FAST = SimpleNamespace(log_target=False, uncertainty=True, scale=10.0)
# Per request: (cap, tokens generated on another engine before, fusion state it brings).
FIRST_OF = {
    "a": (100, 0, None),
    "b": (50, 0, None),
    "c": (30, 5, [2.0, 80.0]),  # moved here with a state: final lengths from its first prompt
    "d": (60, 3, None),  # moved here without one
}


def _raw(r_hat: list[float], sigma: list[float]) -> np.ndarray:
    """The MLP outputs that decode to these R-hat and sigma (no log target)."""
    rows = [[r / FAST.scale, math.log(s / FAST.scale)] for r, s in zip(r_hat, sigma, strict=True)]
    return np.array(rows, dtype=np.float32)


class Reference:
    """fuse_step per request, with the cap and the handed-over state done by hand."""

    def __init__(self) -> None:
        self.state: dict[str, tuple[float, float]] = {}
        self.served: dict[str, float] = {}
        self.generated: dict[str, int] = {}

    def fuse(self, due: bool, ids: list[str], raw: np.ndarray, generated: list[int]) -> None:
        for rid, row, g in zip(ids, raw.astype(np.float64), generated, strict=True):
            cap, before, fusion = FIRST_OF[rid]
            r = max(row[0] * FAST.scale, 0.0)
            sigma = math.exp(row[1]) * FAST.scale
            state = self.state.get(rid)
            if state is None and fusion is not None:
                state = (fusion[0], fusion[1] - before * fusion[0])
            first = FIRST if before == 0 else 1.0
            self.state[rid], _ = fuse_step(state, r, sigma, g, DECAY, POWER, first)
            weight, total = self.state[rid]
            self.served[rid] = max(min(total / weight, cap) - g, 0.0)
            self.generated[rid] = g
        if due:
            for gone in set(self.state) - set(ids):
                del self.state[gone], self.served[gone], self.generated[gone]

    def requests(self) -> dict[str, list[float]]:
        out = {}
        for rid, (weight, total) in self.state.items():
            before = FIRST_OF[rid][1]
            out[rid] = [self.served[rid], self.generated[rid], weight, total + before * weight]
        return out


ROUNDS = [
    # (due, ids, R-hat, sigma, generated)
    (False, ["a", "b"], [40.0, 70.0], [5.0, 20.0], [0, 0]),  # two prompts complete
    (True, ["a", "b", "c"], [30.0, 20.0, 10.0], [4.0, 8.0, 2.0], [10, 12, 0]),  # c arrives
    (True, ["a", "c"], [25.0, 12.0], [2.0, 3.0], [20, 4]),  # b finished: forgotten
    (False, ["d"], [500.0], [1.0], [0]),  # d's prompt completes; a and c are kept
    (True, ["d", "a", "c"], [50.0, 1.0, 9.0], [6.0, 1.0, 0.5], [5, 30, 8]),  # new order
]


def test_each_round_serves_what_fuse_step_gives_each_request() -> None:
    book, ref = FusionBook(DECAY, POWER, FIRST), Reference()
    for due, ids, r_hat, sigma, generated in ROUNDS:
        raw = _raw(r_hat, sigma)
        book.fuse(due, ids, raw, np.array(generated), FAST, FIRST_OF.__getitem__)
        ref.fuse(due, ids, raw, generated)
        got, want = book.requests(), ref.requests()
        assert set(got) == set(want)
        for rid in want:
            assert got[rid] == pytest.approx(want[rid], rel=1e-9), rid
    # d's 500 is over its cap of 60 tokens: it is served the cap less what it generated.
    assert book.requests()["d"][0] <= 60 - 5
    assert set(book.moved) == {"c", "d"}


def test_a_due_round_forgets_the_moved_requests_it_lacks() -> None:
    book = FusionBook(DECAY, POWER, FIRST)
    book.fuse(
        True,
        ["c", "a"],
        _raw([10.0, 10.0], [1.0, 1.0]),
        np.array([0, 0]),
        FAST,
        FIRST_OF.__getitem__,
    )
    assert book.moved == {"c": 5}
    book.fuse(True, ["a"], _raw([9.0], [1.0]), np.array([1]), FAST, FIRST_OF.__getitem__)
    assert book.moved == {} and list(book.requests()) == ["a"]
