"""DecisionGate: each decision once, none past its timeout, none from a deposed leader."""

from __future__ import annotations

import pytest

from star.decisions import DUPLICATE, FENCED, STALE, DecisionGate
from star.wire import Decision

NOW = 1_000_000.0


def decision(id: str, fence: int = 1, age_s: float = 0.0, origin: str = "scheduler") -> Decision:
    return Decision(id, "r", "d0", "d1", 0, -1.0, "predicted", NOW - age_s, fence, origin)


@pytest.mark.parametrize(
    ("stream", "expected"),
    [
        ([decision("a"), decision("b")], [None, None]),
        ([decision("a"), decision("a")], [None, DUPLICATE]),
        # A replayed stream: every decision again, in order.
        ([decision("a"), decision("b"), decision("a"), decision("b")], [None, None, DUPLICATE, DUPLICATE]),
        ([decision("a", age_s=15.1)], [STALE]),
        ([decision("a", age_s=14.9)], [None]),
        # A new leader (fence 2) deposes the old one (fence 1): its late decisions drop.
        ([decision("a", 1), decision("b", 2), decision("c", 1), decision("d", 2)], [None, None, FENCED, None]),
        # Manual decisions carry fence 0 and are not fenced.
        ([decision("a", 3), decision("m", 0, origin="manual")], [None, None]),
        ([decision("m", 0, origin="manual"), decision("m", 0, origin="manual")], [None, DUPLICATE]),
    ],
)  # fmt: skip
def test_the_gate(stream: list[Decision], expected: list[str | None]) -> None:
    gate = DecisionGate(max_age_s=15.0)
    assert [gate.admit(d, NOW) for d in stream] == expected
    assert sum(gate.dropped.values()) == sum(e is not None for e in expected)


def test_a_lower_fence_long_after_the_highest_is_a_new_count() -> None:
    """Redis lost its data and every scheduler restarted: fences count from 1 again.
    Dropped while the old leader's newest decision is younger than max_age_s, then taken."""
    gate = DecisionGate(max_age_s=15.0)
    old = decision("a", 3, age_s=20.0)  # fence 3's newest decision, 20 s ago
    assert gate.admit(old, NOW - 20.0) is None
    assert gate.admit(decision("b", 1, age_s=10.0), NOW - 10.0) == FENCED  # 10 s after it
    assert gate.admit(decision("c", 1), NOW) is None  # 20 s after it: the new count
    assert gate.highest_fence == 1
    assert gate.admit(decision("d", 3), NOW) is None  # and a higher one wins again


def test_memory_is_bounded_and_forgets_the_oldest_first() -> None:
    gate = DecisionGate(max_age_s=15.0, capacity=3)
    for i in range(5):
        assert gate.admit(decision(str(i)), NOW) is None
    assert gate.admit(decision("4"), NOW) == DUPLICATE
    assert gate.admit(decision("0"), NOW) is None  # forgotten: only the last 3 are kept
