"""Table tests: a migration in flight counts on its target (``star.planner.flight``).

The rule the live scheduler's view and the simulator's snapshot both apply;
each case states where every row ends up.
"""

from __future__ import annotations

import numpy as np

from star.planner.flight import Booking, book


def ints(*values: int) -> np.ndarray:
    return np.array(values, dtype=np.int64)


def bools(*values: bool) -> np.ndarray:
    return np.array(values, dtype=np.bool_)


def by_instance(booking: Booking, n: int) -> list[list[tuple[int, bool]]]:
    pairs = list(zip(booking.rows.tolist(), booking.booked.tolist(), strict=True))
    off = booking.offsets.tolist()
    return [pairs[off[i] : off[i + 1]] for i in range(n)]


def test_no_move_keeps_every_row_where_it_is() -> None:
    got = book(3, ints(0, 0, 2), ints(7, 8, 9), ints(), ints(), ints(), bools())
    assert by_instance(got, 3) == [[(0, False), (1, False)], [], [(2, False)]]
    assert not got.in_flight.any() and not got.rebooked.any()


def test_a_move_leaves_its_source_and_is_booked_first_on_its_target() -> None:
    # Rows: key 7 and 8 on instance 0, key 9 on instance 1; key 7 moves 0 -> 1.
    # The move's own row is index 3 (after the three reported rows).
    got = book(3, ints(0, 0, 1), ints(7, 8, 9), ints(7), ints(0), ints(1), bools(True))
    assert by_instance(got, 3) == [[(1, False)], [(3, True), (2, False)], []]
    assert got.in_flight.tolist() == [True, True, False]
    assert got.rebooked.tolist() == [True, True, False]


def test_a_target_that_reports_the_request_keeps_its_own_row() -> None:
    # Key 7 already reported by the target (instance 1): nothing is booked there,
    # its trace stays valid; both instances are still in flight.
    got = book(2, ints(0, 1, 1), ints(8, 9, 7), ints(7), ints(0), ints(1), bools(True))
    assert by_instance(got, 2) == [[(0, False)], [(1, False), (2, False)]]
    assert got.in_flight.tolist() == [True, True]
    assert got.rebooked.tolist() == [True, False]


def test_unknown_load_or_absent_instances_book_nothing_but_still_count() -> None:
    # Move 0: key 7 from 0 to 1, load unknown: off the source, booked nowhere.
    # Move 1: key 5 from an absent instance (-1) to 2: booked on 2, 2 in flight.
    # Move 2: key 9 from 1 to an absent instance: off 1.
    got = book(
        3,
        ints(0, 1, 1, 2),
        ints(7, 9, 4, 6),
        ints(7, 5, 9),
        ints(0, -1, 1),
        ints(1, 2, -1),
        bools(False, True, True),
    )
    assert by_instance(got, 3) == [[], [(2, False)], [(5, True), (3, False)]]
    assert got.in_flight.tolist() == [True, True, True]
    assert got.rebooked.tolist() == [True, True, True]


def test_several_moves_onto_one_target_keep_their_order() -> None:
    got = book(
        2, ints(0, 0, 1), ints(1, 2, 3), ints(1, 2), ints(0, 0), ints(1, 1), bools(True, True)
    )
    assert by_instance(got, 2) == [[], [(3, True), (4, True), (2, False)]]


def test_a_settling_move_is_booked_but_keeps_no_instance_in_flight() -> None:
    # Key 7 moved 0 -> 1 and resumed, but instance 0's last report (before the
    # release) still lists it and instance 1 has not reported it yet.
    got = book(
        3, ints(0, 0, 1), ints(7, 8, 9), ints(7), ints(0), ints(1), bools(True), bools(False)
    )
    assert by_instance(got, 3) == [[(1, False)], [(3, True), (2, False)], []]
    assert got.in_flight.tolist() == [False, False, False]
    assert got.rebooked.tolist() == [True, True, False]


def test_offsets_given_or_counted_book_the_same() -> None:
    owner, key = ints(0, 0, 2, 2), ints(1, 2, 3, 4)
    offsets = ints(0, 2, 2, 4)
    for moves in ((ints(), ints(), ints(), bools()), (ints(2), ints(0), ints(1), bools(True))):
        counted = book(3, owner, key, *moves)
        given = book(3, owner, key, *moves, offsets=offsets)
        assert by_instance(given, 3) == by_instance(counted, 3)
        assert given.in_flight.tolist() == counted.in_flight.tolist()
        assert given.rebooked.tolist() == counted.rebooked.tolist()
