"""The fleet as ``star top`` shows it: a fold of decoded bus entries (sans-IO).

:class:`TopState` takes :class:`~star.wire.Report`, :class:`~star.wire.Decision`
and :class:`~star.wire.Event` messages in any interleaving of the three streams
(an outcome may be folded before its decision) and :meth:`TopState.view`
returns a :class:`FleetView` for one instant: plain dataclasses, JSON-ready
with :func:`dataclasses.asdict`. It reads no clock: ``now`` (wall-clock
seconds, the time base of the messages' ``ts``) is always passed in.
"""

from __future__ import annotations

import collections
import re
from dataclasses import dataclass, field

from star.wire import Decision, Event, EventKind, Message, Report

# Events that end a migration (the outcome a decision's row shows).
OUTCOMES: dict[EventKind, str] = {
    EventKind.RESUMED: "resumed",
    EventKind.ABORTED: "aborted",
    EventKind.REFUSED: "refused",
    EventKind.EXPIRED: "expired",
}
# Events on the way there (the phase an in-flight migration shows).
PHASES: dict[EventKind, str] = {
    EventKind.MIGRATING: "migrating",
    EventKind.RELEASED: "released",
    EventKind.KV_PULLED: "kv_pulled",
}


@dataclass(frozen=True, slots=True)
class InstanceRow:
    """One worker, from its newest report and the lifecycle events after it."""

    instance: str
    role: str
    used_tokens: int
    capacity_tokens: int
    kv_fraction: float  # used / capacity, 0..1 (may exceed 1 if a worker over-reports)
    running: int
    waiting: int
    step_ms: float
    preemptions: int  # cumulative since the engine started
    age_s: float  # since the report was made
    state: str  # "ok", "draining", "stale" or "down"


@dataclass(frozen=True, slots=True)
class DecisionRow:
    """One migration decision and where it stands."""

    id: str
    request: str
    source: str
    target: str
    delta_v: float
    reason: str  # "balance" or "drain"
    origin: str  # "scheduler" or "manual"
    mode: str
    age_s: float
    status: str  # an outcome (resumed, aborted, ...), a phase, "decided" or "unknown"
    detail: str  # aborted: which side; refused: why
    took_s: float | None  # decision to outcome


@dataclass(frozen=True, slots=True)
class Leader:
    node: str
    fence: int
    mode: str | None  # from its newest decision; None until it decided something


@dataclass(frozen=True, slots=True)
class FleetView:
    """What one frame shows."""

    now: float
    leader: Leader | None
    decode: list[InstanceRow]
    prefill: list[InstanceRow]
    in_flight: list[DecisionRow]  # oldest first
    decisions: list[DecisionRow]  # newest first
    outcomes: dict[str, int]  # count per status over ``decisions``
    errors: list[str] = field(default_factory=list)


@dataclass(slots=True)
class _Migration:
    phase: str = "decided"
    outcome: str | None = None
    detail: str = ""
    at: float = 0.0


def natural_key(name: str) -> list[int | str]:
    """``decode-2`` before ``decode-10``."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


class TopState:
    """Folds bus messages into what ``star top`` shows.

    ``staleness_s`` and ``decision_timeout_s`` are the scheduler's (an instance
    silent that long is stale; a decision without outcome that long is no
    longer in flight); an instance silent for ``forget_s`` leaves the view.
    At most ``keep`` decisions are kept.
    """

    def __init__(
        self,
        staleness_s: float = 3.0,
        decision_timeout_s: float = 15.0,
        forget_s: float = 60.0,
        keep: int = 200,
    ) -> None:
        self.staleness_s = staleness_s
        self.decision_timeout_s = decision_timeout_s
        self.forget_s = forget_s
        self.reports: dict[str, Report] = {}
        self.down_at: dict[str, float] = {}  # worker_down, newer than its last report
        self.stale_at: dict[str, float] = {}  # instance_stale, newer than its last report
        self.decisions: collections.deque[Decision] = collections.deque(maxlen=keep)
        # Keyed by migration id, bounded: outcomes may come before their decision.
        self.migrations: collections.OrderedDict[str, _Migration] = collections.OrderedDict()
        self._keep_migrations = keep * 10
        self.leader_event: tuple[str, int, float] | None = None  # node, fence, ts
        self.leader_lock: tuple[str, int] | None = None
        self.lock_known = False  # the lock was read (then it, not the events, says who leads)
        self.mode: str | None = None
        self.errors: list[str] = []

    # -- folding -------------------------------------------------------------

    def fold(self, msg: Message) -> None:
        """Take one decoded bus message; other kinds are ignored."""
        if isinstance(msg, Report):
            old = self.reports.get(msg.instance)
            if old is None or (msg.ts, msg.seq) >= (old.ts, old.seq):
                self.reports[msg.instance] = msg
        elif isinstance(msg, Decision):
            self.decisions.append(msg)
            if msg.origin == "scheduler":
                self.mode = msg.mode
        elif isinstance(msg, Event):
            self._event(msg)

    def fold_all(self, msgs: list[Message]) -> None:
        for msg in msgs:
            self.fold(msg)

    def set_leader_lock(self, value: str | None) -> None:
        """The ``<prefix>:leader`` lock as read (``<node>|<fence>``), or None if unheld."""
        self.lock_known = True
        if not value:
            self.leader_lock = None
            return
        node, _, fence = value.rpartition("|")
        self.leader_lock = (node, int(fence)) if fence.isdigit() else (value, 0)

    def _event(self, ev: Event) -> None:
        kind = ev.event
        if kind in OUTCOMES or kind in PHASES:
            if not ev.migration:
                return
            m = self.migrations.get(ev.migration)
            if m is None:
                m = self.migrations[ev.migration] = _Migration()
                while len(self.migrations) > self._keep_migrations:
                    self.migrations.popitem(last=False)
            if kind in OUTCOMES:
                if m.outcome is None:  # the first outcome is the one that counts
                    m.outcome, m.at = OUTCOMES[kind], ev.ts
                    m.detail = ev.detail or str(ev.data.get("reason", ""))
            else:
                m.phase = PHASES[kind]
        elif kind is EventKind.WORKER_DOWN and ev.instance:
            self.down_at[ev.instance] = max(ev.ts, self.down_at.get(ev.instance, 0.0))
        elif kind is EventKind.WORKER_UP and ev.instance:
            if self.down_at.get(ev.instance, 0.0) <= ev.ts:
                self.down_at.pop(ev.instance, None)
        elif kind is EventKind.INSTANCE_STALE and ev.instance:
            self.stale_at[ev.instance] = max(ev.ts, self.stale_at.get(ev.instance, 0.0))
        elif kind is EventKind.LEADER:
            node = ev.origin.removeprefix("scheduler:")
            fence = ev.data.get("fence", 0)
            if self.leader_event is None or ev.ts >= self.leader_event[2]:
                self.leader_event = (node, fence if isinstance(fence, int) else 0, ev.ts)

    # -- the view --------------------------------------------------------------

    def view(self, now: float) -> FleetView:
        decode: list[InstanceRow] = []
        prefill: list[InstanceRow] = []
        for name in sorted(self.reports, key=natural_key):
            row = self._instance(self.reports[name], now)
            if row is None:
                continue
            (prefill if row.role == "prefill" else decode).append(row)
        rows = [self._decision(d, now) for d in reversed(self.decisions)]
        in_flight = [r for r in reversed(rows) if r.status in ("decided", *PHASES.values())]
        outcomes: dict[str, int] = {}
        for r in rows:
            outcomes[r.status] = outcomes.get(r.status, 0) + 1
        return FleetView(
            now=now,
            leader=self._leader(),
            decode=decode,
            prefill=prefill,
            in_flight=in_flight,
            decisions=rows,
            outcomes=outcomes,
            errors=list(self.errors),
        )

    def _instance(self, r: Report, now: float) -> InstanceRow | None:
        age = now - r.ts
        if age > self.forget_s:
            return None
        if self.down_at.get(r.instance, -1.0) >= r.ts:
            state = "down"
        elif age > self.staleness_s or self.stale_at.get(r.instance, -1.0) >= r.ts:
            state = "stale"
        elif r.draining:
            state = "draining"
        else:
            state = "ok"
        return InstanceRow(
            instance=r.instance,
            role=r.role,
            used_tokens=r.used_tokens,
            capacity_tokens=r.capacity_tokens,
            kv_fraction=r.used_tokens / r.capacity_tokens if r.capacity_tokens > 0 else 0.0,
            running=len(r.requests),
            waiting=r.waiting,
            step_ms=r.step_time_s * 1000,
            preemptions=r.preemptions,
            age_s=max(0.0, age),
            state=state,
        )

    def _decision(self, d: Decision, now: float) -> DecisionRow:
        m = self.migrations.get(d.id)
        took: float | None = None
        detail = ""
        if m is not None and m.outcome is not None:
            status, detail, took = m.outcome, m.detail, max(0.0, m.at - d.ts)
        elif now - d.ts > self.decision_timeout_s:
            status = "unknown"  # the scheduler expires it; its event is not in sight
        else:
            status = m.phase if m is not None else "decided"
        return DecisionRow(
            id=d.id,
            request=d.request,
            source=d.source,
            target=d.target,
            delta_v=d.delta_v,
            reason=d.reason,
            origin=d.origin,
            mode=d.mode,
            age_s=max(0.0, now - d.ts),
            status=status,
            detail=detail,
            took_s=took,
        )

    def _leader(self) -> Leader | None:
        if self.lock_known:
            if self.leader_lock is None:
                return None
            node, fence = self.leader_lock
        elif self.leader_event is not None:
            node, fence, _ts = self.leader_event
        else:
            return None
        return Leader(node, fence, self.mode)
