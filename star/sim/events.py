"""The event heap: keyed by (time, priority, sequence), so a run is a pure
function of its configuration and seed.

Priority orders events that fall at the same instant: a decode instance
finishes its iteration before anything looks at it, and the scheduler tick
sees the state after everything else that happened at that time.
"""

from __future__ import annotations

import enum
import heapq
import itertools
from typing import NamedTuple


class Kind(enum.IntEnum):
    """Event kinds; the value is the priority among simultaneous events."""

    WAKE = 0  # a decode instance reaches its next internal state change
    MIGRATED = 1  # a D->D KV transfer completed
    JOIN = 2  # a request's KV reached its decode instance (P->D)
    PREFILLED = 3  # a prefill finished: first token out, dispatch to decode
    ARRIVAL = 4  # a request arrives at the cluster
    TICK = 5  # scheduler tick and metrics sample


class Event(NamedTuple):
    """One scheduled event; ``a`` and ``b`` are kind-specific integers."""

    time: float
    kind: Kind
    seq: int
    a: int
    b: int


class EventQueue:
    """A min-heap of events ordered by (time, kind, seq).

    Entries are plain ``(time, kind, seq, a, b)`` tuples (what :class:`Event`
    names): the engine's loop pops :attr:`heap` directly, one tuple per event
    being the cheapest form Python has.
    """

    __slots__ = ("_count", "heap")

    def __init__(self) -> None:
        self.heap: list[tuple[float, int, int, int, int]] = []
        self._count = itertools.count(1)

    def push(self, time: float, kind: int, a: int = 0, b: int = 0) -> None:
        """Schedule an event; equal (time, kind) pairs pop in push order."""
        heapq.heappush(self.heap, (time, kind, next(self._count), a, b))

    def pop(self) -> Event:
        """Remove and return the earliest event (IndexError when empty)."""
        time, kind, seq, a, b = heapq.heappop(self.heap)
        return Event(time, Kind(kind), seq, a, b)

    def peek_time(self) -> float:
        """Time of the earliest event (inf when empty)."""
        return self.heap[0][0] if self.heap else float("inf")

    def __len__(self) -> int:
        return len(self.heap)
