"""A migration in flight counts on its target: the rule, written once (docs/design.md §3).

From the moment a move is decided until its outcome is known, the planner
sees the request on the target and not on the source: booked on the target
with its last known load, busy (not migratable), ahead of the target's own
requests. Both instances are "in flight" and take part in no other move. A
target that already reports the request (the handoff resumed, its outcome
not read yet) keeps its own row instead. An instance with something booked
on or off it has no valid pre-simulated trace of its own.

The live scheduler (``scheduler/view.py``) and the simulator
(``star.sim.snapshot``) both order the planner's rows with :func:`book`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from star.planner.trace import BoolArray, IntArray


@dataclass(frozen=True, slots=True)
class Booking:
    """The planner's rows with the moves in flight booked on their targets.

    ``rows`` indexes the caller's rows: the reported ones ``0..R-1``, then one
    per move ``R..R+M-1`` (its request as last known), instance by instance;
    instance i owns ``rows[offsets[i]:offsets[i + 1]]``.
    """

    rows: IntArray
    offsets: IntArray  # (n + 1,)
    booked: BoolArray  # per entry of rows: a request moving in (busy, not migratable)
    in_flight: BoolArray  # per instance: source or target of a move in flight
    rebooked: BoolArray  # per instance: something booked on or off it


def book(
    n: int,
    owner: IntArray,
    key: IntArray,
    move_key: IntArray,
    move_source: IntArray,
    move_target: IntArray,
    move_known: BoolArray,
    move_active: BoolArray | None = None,
    *,
    offsets: IntArray | None = None,
) -> Booking:
    """Book the moves in flight on their targets.

    ``owner`` and ``key``: the instance reporting each row (non-decreasing)
    and the request's identity. Per move in flight: the request's key, its
    source and target (-1: not among the n instances) and whether its load
    is known (a move whose load is not known is booked nowhere, but still
    keeps its instances in flight and its request off the source).
    ``move_active`` (default all): a move that is over but whose source has
    not reported since (the live scheduler's settling moves) is booked the
    same way but keeps neither instance in flight. ``offsets`` (n + 1,), when
    the caller has them: instance i reports rows ``offsets[i]:offsets[i + 1]``.
    """
    r = owner.size
    if offsets is None:
        offsets = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(np.bincount(owner, minlength=n), out=offsets[1:])
    if move_key.size == 0:  # nothing in flight: every row stays where it is
        none = np.zeros(n, dtype=np.bool_)
        return Booking(
            np.arange(r, dtype=np.int64), offsets, np.zeros(r, dtype=np.bool_), none, none.copy()
        )
    in_flight = np.zeros(n, dtype=np.bool_)
    active = np.ones(move_key.size, np.bool_) if move_active is None else move_active
    in_flight[move_source[(move_source >= 0) & active]] = True
    in_flight[move_target[(move_target >= 0) & active]] = True
    keep = np.ones(r, dtype=np.bool_)
    take = np.zeros(move_key.size, dtype=np.bool_)
    rebooked = np.zeros(n, dtype=np.bool_)
    for m, (k, s, t, known) in enumerate(
        zip(
            move_key.tolist(),
            move_source.tolist(),
            move_target.tolist(),
            move_known.tolist(),
            strict=True,
        )
    ):
        if s >= 0:
            rebooked[s] = True
            lo = int(offsets[s])
            keep[lo + np.flatnonzero(key[lo : offsets[s + 1]] == k)] = False
        if t >= 0 and known and not (key[offsets[t] : offsets[t + 1]] == k).any():
            take[m] = True
            rebooked[t] = True
    moved = np.flatnonzero(take)
    if not moved.size and keep.all():
        rows = np.arange(r, dtype=np.int64)
        return Booking(rows, offsets, np.zeros(r, dtype=np.bool_), in_flight, rebooked)
    own = np.flatnonzero(keep)
    # Stable: within an instance, booked rows (first in the concatenation) stay ahead.
    where = np.concatenate((move_target[moved], owner[own]))
    order = np.argsort(where, kind="stable")
    rows = np.concatenate((r + moved, own))[order]
    booked = np.concatenate((np.ones(moved.size, np.bool_), np.zeros(own.size, np.bool_)))[order]
    offsets = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(np.bincount(where, minlength=n), out=offsets[1:])
    return Booking(rows, offsets, booked, in_flight, rebooked)
