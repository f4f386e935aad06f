"""A fleet's bus folded into ``star top``'s state (:class:`star.top.TopState`).

:class:`Feed` reads ``<prefix>:reports``, ``:decisions`` and ``:events`` in
order with :class:`~star.bus.Subscriber`, starting a window back, and the
leader lock; :mod:`star.top` folds and renders without IO.
"""

from __future__ import annotations

import asyncio
import time

from star.bus import Bus, Subscriber, as_str
from star.top import TopState
from star.wire import Decision, Event, Report

# Reads per stream and refresh: a backlog larger than this (thousands of
# reports) is caught up over several frames instead of stalling one.
MAX_READS = 64


class Feed:
    """The three streams and the leader lock, folded into one :class:`TopState`."""

    def __init__(self, bus: Bus, state: TopState, window_s: float) -> None:
        self.bus = bus
        self.state = state
        # A time-based id: Redis stream ids are its millisecond clock.
        start = f"{max(0, int((time.time() - window_s) * 1000))}-0"
        self.subs = [
            Subscriber(bus, "reports", Report, start=start),
            Subscriber(bus, "decisions", Decision, start=start),
            Subscriber(bus, "events", Event, start=start),
        ]

    async def refresh(self) -> None:
        """Fold what is new on the bus (raises :class:`BusUnavailable`)."""
        await asyncio.gather(*(self._drain(sub) for sub in self.subs), self._leader())

    async def _drain(self, sub: Subscriber) -> None:
        for _ in range(MAX_READS):
            entries = await sub.read(block_ms=1)
            self.state.fold_all([e.msg for e in entries])
            if len(entries) < self.bus.settings.read_count:
                return

    async def _leader(self) -> None:
        raw = await self.bus.retrying(
            "GET leader", lambda: self.bus.redis.get(self.bus.keys.leader)
        )
        self.state.set_leader_lock(as_str(raw) if raw else None)
