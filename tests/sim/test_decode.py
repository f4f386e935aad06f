"""Closed-form decode iterations and the event heap."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from star.sim.decode import duration, steps_done, steps_until
from star.sim.events import EventQueue, Kind


def test_duration_is_the_sum_of_iterations() -> None:
    a, b, load, batch = 0.008, 1e-7, 12_345, 7
    by_hand = sum(a + b * (load + batch * j) for j in range(50)) + 0.3
    assert abs(duration(50, load, batch, a, b, 0.3) - by_hand) < 1e-12
    assert duration(0, load, batch, a, b, 0.3) == 0.0


@settings(max_examples=100, deadline=None)
@given(
    elapsed=st.floats(0.0, 50.0),
    load=st.integers(0, 400_000),
    batch=st.integers(1, 64),
    b=st.sampled_from([0.0, 1e-8, 1e-7, 1e-6]),
    extra=st.floats(0.0, 2.0),
    cap=st.integers(1, 100_000),
)
def test_steps_until_is_the_first_boundary_at_or_after(
    elapsed: float, load: int, batch: int, b: float, extra: float, cap: int
) -> None:
    a = 0.008
    m = steps_until(elapsed, load, batch, a, b, extra, cap)
    assert 0 <= m <= cap
    if elapsed <= 0:
        assert m == 0
        return
    if m < cap:
        assert duration(m, load, batch, a, b, extra) >= elapsed
    if m > 1:
        assert duration(m - 1, load, batch, a, b, extra) < elapsed


@settings(max_examples=60, deadline=None)
@given(
    elapsed=st.lists(st.floats(-1.0, 30.0), min_size=1, max_size=20),
    load=st.integers(0, 300_000),
    batch=st.integers(0, 32),
)
def test_steps_done_is_the_last_boundary_at_or_before(
    elapsed: list[float], load: int, batch: int
) -> None:
    a, b, extra, cap = 0.01, 1e-7, 0.05, 5_000
    e = np.array(elapsed)
    n = e.size
    got = steps_done(
        e,
        np.full(n, float(load)),
        np.full(n, float(batch)),
        a,
        b,
        np.full(n, extra),
        np.full(n, float(cap if batch else 0)),
    )
    for m, el in zip(got.tolist(), elapsed, strict=True):
        if batch == 0:
            assert m == 0
            continue
        # Exact up to a boundary that rounding puts on the other side.
        assert duration(m, load, batch, a, b, extra) <= el + 1e-9 or m == 0
        if m < cap:
            assert duration(m + 1, load, batch, a, b, extra) > el - 1e-9


def test_event_queue_orders_by_time_then_kind_then_push_order() -> None:
    q = EventQueue()
    q.push(1.0, Kind.TICK, 1)
    q.push(1.0, Kind.WAKE, 2)
    q.push(0.5, Kind.ARRIVAL, 3)
    q.push(1.0, Kind.WAKE, 4)
    assert q.peek_time() == 0.5
    order = [(e.time, e.kind, e.a) for e in (q.pop() for _ in range(len(q)))]
    assert order == [
        (0.5, Kind.ARRIVAL, 3),
        (1.0, Kind.WAKE, 2),
        (1.0, Kind.WAKE, 4),
        (1.0, Kind.TICK, 1),
    ]
    assert q.peek_time() == float("inf")
