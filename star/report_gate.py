"""Which worker reports a proxy or scheduler takes (issue 27: reports in sequence).

A report moves an instance's address and load in every proxy's directory and
in the scheduler's view. Signed (``star.bus.signing``), it cannot be forged,
but a genuine old one can come back: a stream that went back (a restored
snapshot, a failover to a lagging replica: readers start again from ``0-0``),
an entry reclaimed late, or someone with write access to Redis copying an old
entry to the end of the stream. Taken naively, the last one read wins and an
instance's address moves back to where a previous incarnation of it ran.

A worker says which incarnation it is (``Report.incarnation``: its process's
start, wall-clock microseconds) and numbers its reports (``Report.seq``, from
1 in each incarnation). :class:`ReportGate` admits, per instance:

- **stale**: none dated more than ``max_age_s`` before this host's clock
  (its ``ts``; the caller's staleness plus the clock skew allowed), nor more
  than ``skew_s`` after it;
- **replayed**: from the incarnation taken last, only a higher ``seq`` than
  the last one taken;
- **retired**: nothing from an incarnation that another one replaced (the
  last ``retired`` of them are remembered per instance);
- **older**: a new incarnation only with a report no older (its ``ts``,
  within ``skew_s``: a worker restarted on another host) than the last one
  taken; it retires the one before.

A report that does not say (``incarnation`` UNSET or 0: a worker from
before the field, a hand-built report) keeps the rule that held before:
refused only when both its ``seq`` and ``ts`` are below the last one's.

Sans IO: the caller passes the time; :func:`report_refusal` is its log line.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field
from typing import Any

from star.wire import Report

STALE = "stale"
REPLAYED = "replayed"
RETIRED = "retired"
OLDER = "older"
SKEW_S = 2.0  # wall-clock difference allowed between a worker's host and a reader's
RETIRED_KEPT = 8  # incarnations remembered per instance once replaced


@dataclass(slots=True)
class _Last:
    incarnation: int
    seq: int
    ts: float
    retired: collections.deque[int]


@dataclass
class ReportGate:
    """Admit a worker's reports in sequence per incarnation, none too old."""

    max_age_s: float
    skew_s: float = SKEW_S
    retired: int = RETIRED_KEPT
    refused: collections.Counter[str] = field(default_factory=collections.Counter)
    _last: dict[str, _Last] = field(default_factory=dict)

    def admit(self, report: Report, now: float) -> str | None:
        """None: take ``report`` (``now``: wall-clock seconds); else why not (counted)."""
        why = self._why(report, now)
        if why is not None:
            self.refused[why] += 1
        return why

    def _why(self, report: Report, now: float) -> str | None:
        if now - report.ts > self.max_age_s or report.ts - now > self.skew_s:
            return STALE
        incarnation = report.incarnation or 0  # UNSET: not said
        last = self._last.get(report.instance)
        if last is None:
            self._last[report.instance] = _Last(
                incarnation, report.seq, report.ts, collections.deque(maxlen=self.retired)
            )
            return None
        if incarnation == last.incarnation:
            if incarnation == 0:
                if report.seq < last.seq and report.ts <= last.ts:
                    return REPLAYED
            elif report.seq <= last.seq:
                return REPLAYED
        elif incarnation in last.retired:
            return RETIRED
        elif report.ts < last.ts - self.skew_s:
            return OLDER
        else:
            last.retired.append(last.incarnation)
            last.incarnation = incarnation
        last.seq, last.ts = report.seq, report.ts
        return None


def report_refusal(log: Any, gate: ReportGate, why: str, report: Report) -> None:
    """One warning for the first report refused for each reason and every 1,000th
    after (a replayed stream refuses thousands), debug lines between."""
    count = gate.refused[why]
    fields = {
        "reason": why,
        "instance": report.instance,
        "incarnation": report.incarnation or 0,
        "seq": report.seq,
        "count": count,
    }
    if count == 1 or count % 1000 == 0:
        log.warning("report_refused", **fields)
    else:
        log.debug("report_refused", **fields)
