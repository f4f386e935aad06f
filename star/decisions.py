"""Which decisions a consumer applies (issue 27 item 1, the fence and the replay).

A proxy follows ``<prefix>:decisions`` to move its requests, a scheduler to
book moves in flight. Read naively, a stream that went back (a restored
snapshot, a failover to a lagging replica: readers start again from ``0-0``)
re-applies every old decision, and a deposed leader's late decision competes
with the new leader's. :class:`DecisionGate` lets each decision through once:

- **duplicate**: its id was seen already (the last ``capacity`` ids);
- **stale**: older than ``max_age_s`` (``scheduler.decision_timeout_s``: the
  scheduler has expired it by then) by its own ``ts`` against this host's
  clock;
- **fenced**: a scheduler's decision whose fence is below the highest fence
  seen, i.e. from a leader that has been replaced (docs/design.md §4.2).
  Manual decisions (``star migrate``, fence 0) are not fenced. The highest
  fence holds for ``max_age_s`` after its leader's newest decision: a Redis
  that lost its data while every scheduler restarted counts fences from 1
  again, and a lower fence after that long is that new leader's, not a
  deposed one's (moves pause for at most ``max_age_s``, never for good).

Sans IO: the caller passes the time; :func:`report_drop` is its log line.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field
from typing import Any

from star.wire import Decision

DUPLICATE = "duplicate"
STALE = "stale"
FENCED = "fenced"
CAPACITY = 100_000  # ids remembered: a replayed stream is trimmed to less (bus.maxlen_decisions)


@dataclass
class DecisionGate:
    """Admit each decision at most once, none too old, none from a deposed leader."""

    max_age_s: float
    capacity: int = CAPACITY
    highest_fence: int = 0
    highest_ts: float = 0.0  # the newest decision's ts under the highest fence
    dropped: collections.Counter[str] = field(default_factory=collections.Counter)
    _seen: collections.OrderedDict[str, None] = field(default_factory=collections.OrderedDict)

    def admit(self, decision: Decision, now: float) -> str | None:
        """None: apply ``decision`` (``now``: wall-clock seconds); else why not."""
        why = self._why(decision, now)
        if why is not None:
            self.dropped[why] += 1
            return why
        if decision.origin == "scheduler":
            if decision.fence != self.highest_fence:  # a newer leader, or a new count
                self.highest_fence, self.highest_ts = decision.fence, decision.ts
            self.highest_ts = max(self.highest_ts, decision.ts)
        return None

    def _why(self, decision: Decision, now: float) -> str | None:
        if decision.id in self._seen:
            return DUPLICATE
        self._seen[decision.id] = None
        if len(self._seen) > self.capacity:
            self._seen.popitem(last=False)
        if now - decision.ts > self.max_age_s:
            return STALE
        if (
            decision.origin == "scheduler"
            and decision.fence < self.highest_fence
            and decision.ts <= self.highest_ts + self.max_age_s
        ):
            return FENCED
        return None


def report_drop(log: Any, gate: DecisionGate, why: str, decision: Decision) -> None:
    """One warning for the first decision dropped for each reason and every 1,000th after
    (a replayed stream drops thousands), debug lines between."""
    count = gate.dropped[why]
    fields = {"reason": why, "decision": decision.id, "fence": decision.fence, "count": count}
    if count == 1 or count % 1000 == 0:
        log.warning("decision_dropped", highest_fence=gate.highest_fence, **fields)
    else:
        log.debug("decision_dropped", **fields)
