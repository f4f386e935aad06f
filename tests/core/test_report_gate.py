"""ReportGate: a worker's reports in sequence per incarnation, none too old."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from star.report_gate import OLDER, REPLAYED, RETIRED, STALE, ReportGate
from star.wire import Report

NOW = 1_000_000.0
MAX_AGE_S = 12.0


def report(
    seq: int, inc: int = 7, age_s: float = 0.0, address: str = "", instance: str = "decode-0"
) -> Report:
    return Report(
        instance=instance,
        role="decode",
        seq=seq,
        ts=NOW - age_s,
        address=address or f"10.0.0.{inc % 250}:{seq}",
        capacity_tokens=1000,
        used_tokens=0,
        bytes_per_token=1,
        step_time_s=0.01,
        delta=32,
        trace=[0.0],
        requests=[],
        incarnation=inc,
    )


R = report


@pytest.mark.parametrize(
    ("stream", "expected"),
    [
        ([R(1), R(2), R(3)], [None, None, None]),
        # The same report twice, an older one after a newer one (reordered, reclaimed).
        ([R(1), R(1)], [None, REPLAYED]),
        ([R(1), R(3), R(2)], [None, None, REPLAYED]),
        # The stream re-read from 0-0: every report again, in order.
        ([R(1), R(2), R(1), R(2)], [None, None, REPLAYED, REPLAYED]),
        # Too old or from the future, by this host's clock.
        ([R(1, age_s=12.1)], [STALE]),
        ([R(1, age_s=11.9)], [None]),
        ([R(1, age_s=-2.1)], [STALE]),
        ([R(1, age_s=-1.9)], [None]),
        # A restart: the new incarnation counts from 1 and retires the old one,
        # whose reports (a high seq among them) are refused from then on.
        ([R(900, 7, 3.0), R(1, 8, 1.0), R(901, 7, 2.0), R(2, 8, 0.0)], [None, None, RETIRED, None]),
        # A new incarnation dated well before the last report taken: an old one
        # that was never taken (read late); within the skew (another host's clock) it is taken.
        ([R(5, 7, 0.0), R(1, 8, 3.0)], [None, OLDER]),
        ([R(5, 7, 0.0), R(1, 8, 1.5)], [None, None]),
        # Incarnation 0 (not said): the rule before, refused when seq and ts are both older.
        ([R(1, 0, 1.0), R(1, 0, 0.0), R(2, 0, 0.5), R(1, 0, 2.0)], [None, None, None, REPLAYED]),
        # Instances are counted apart.
        ([R(5), R(1, instance="decode-1"), R(4)], [None, None, REPLAYED]),
    ],
)  # fmt: skip
def test_the_gate(stream: list[Report], expected: list[str | None]) -> None:
    gate = ReportGate(MAX_AGE_S)
    assert [gate.admit(r, NOW) for r in stream] == expected
    assert sum(gate.refused.values()) == sum(e is not None for e in expected)


def test_retired_incarnations_are_bounded() -> None:
    gate = ReportGate(MAX_AGE_S, retired=2)
    for inc in range(1, 6):
        assert gate.admit(R(1, inc), NOW) is None
    assert gate.admit(R(2, 4), NOW) == RETIRED
    assert gate.admit(R(2, 3), NOW) == RETIRED
    # Forgotten (bounded memory): taken as a new incarnation again, within the skew.
    assert gate.admit(R(2, 1), NOW) is None


# -- properties -----------------------------------------------------------------------

_history = st.lists(
    st.tuples(
        st.integers(1, 4),  # incarnation (start order)
        st.integers(1, 30),  # seq
    ),
    min_size=1,
    max_size=40,
)


def _genuine(history: list[tuple[int, int]]) -> list[Report]:
    """What one instance's workers really sent, in order: incarnations one after
    another (each starting later), seq rising from 1 in each, ts rising."""
    out: list[Report] = []
    for n, (inc, count) in enumerate(sorted(dict(history).items())):
        for seq in range(1, count + 1):
            age = 10.0 - 0.01 * (len(out) + n)
            out.append(R(seq, inc, age, address=f"host{inc}:{seq}"))
    return out


@settings(max_examples=300, deadline=None, database=None, derandomize=True)
@given(history=_history, replay=st.data())
def test_replaying_old_reports_never_moves_an_address_back(
    history: list[tuple[int, int]], replay: st.DataObject
) -> None:
    """Whatever old reports come back, in any order, after the genuine stream:
    none is taken, so the address taken last is still the newest one's."""
    genuine = _genuine(history)
    gate = ReportGate(MAX_AGE_S)
    address = ""  # what a directory would dial
    for r in genuine:
        assert gate.admit(r, NOW) is None  # the genuine stream in order: every report taken
        address = r.address
    last = genuine[-1]
    replayed = replay.draw(st.lists(st.sampled_from(genuine), max_size=60))
    for r in replayed:
        if gate.admit(r, NOW) is None:
            address = r.address
    assert address == f"host{last.incarnation}:{last.seq}"
    assert gate.refused.total() == len(replayed)
    # The live worker's next report is still taken.
    assert gate.admit(R(last.seq + 1, last.incarnation, 0.0), NOW) is None


@settings(max_examples=300, deadline=None, database=None, derandomize=True)
@given(
    st.lists(
        st.tuples(st.integers(0, 3), st.integers(0, 8), st.floats(-3.0, 15.0)),
        max_size=40,
    )
)
def test_taken_reports_rise_per_incarnation(stream: list[tuple[int, int, float]]) -> None:
    """Any stream at all: within one incarnation (not 0) the taken seqs strictly rise,
    no taken report is stale, and once replaced an incarnation is never taken again."""
    gate = ReportGate(MAX_AGE_S)
    last_seq: dict[int, int] = {}
    current: int | None = None
    replaced: set[int] = set()
    for inc, seq, age in stream:
        r = R(seq, inc, age)
        if gate.admit(r, NOW) is not None:
            continue
        assert -2.0 <= age <= MAX_AGE_S
        assert inc not in replaced
        if current is not None and inc != current:
            replaced.add(current)
        current = inc
        if inc:
            assert seq > last_seq.get(inc, -1)
            last_seq[inc] = seq
