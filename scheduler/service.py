"""``star scheduler``: reports in, planner on a timer, decisions out (paper Alg. 1).

Every node (standby included) reads every report through its own consumer
group into a :class:`~scheduler.view.ClusterView` and follows the events
(migrations resolved, ``worker_down``) and decisions; every ``interval_s``,
on a drift-free schedule, it marks stale instances, expires decisions and
plans, and the leader (:mod:`scheduler.leader`) publishes the decisions and
the dispatch view ``<prefix>:load``. A Redis outage of any length is waited
out by every task.
"""

from __future__ import annotations

import asyncio
import os
import socket
import time
import uuid
from typing import Any

import structlog

from scheduler.leader import Leadership
from scheduler.metrics import SchedulerMetrics
from scheduler.view import ClusterView, Snapshot, decision_for, rebuild
from star.bus import TRANSIENT, Bus, BusUnavailable, GroupReader, Outage, Subscriber
from star.bus.metrics import RefusalCollector
from star.decisions import DecisionGate, report_drop
from star.planner.core import plan_on
from star.planner.types import ModeKind, Plan, PlannerParams
from star.predictor.live import AccuracyTracker
from star.process import SafePointCollector, Service, set_gc_gen0_threshold
from star.report_gate import SKEW_S, ReportGate, report_refusal
from star.settings import Settings
from star.wire import Decision, Event, EventKind, Message, Report, WireError, decode

log = structlog.get_logger(__name__)

# A batch of reports (up to bus.read_count) is decoded and applied this many
# at a time, yielding to the event loop in between (~0.2-0.25 ms of CPU each
# at 64 requests: decode, view, predictor accuracy).
REPORTS_PER_YIELD = 16

# What a tick's publishing raises while Redis is unreachable.
REDIS_DOWN: tuple[type[BaseException], ...] = (BusUnavailable, *TRANSIENT)


def default_node_name() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


class SchedulerService(Service):
    name = "scheduler"

    def __init__(self, settings: Settings, node: str | None = None) -> None:
        super().__init__(drain_timeout_s=2.0)
        self.settings = settings
        self.node = node or default_node_name()
        self.params = PlannerParams.from_settings(settings)
        self.view = ClusterView.for_scheduler(settings.scheduler, self.params)
        # Reports in sequence per incarnation, none older than staleness (a
        # replayed one moves no instance's address or load back).
        self.report_gate = ReportGate(settings.scheduler.staleness_s + SKEW_S)
        self.metrics = SchedulerMetrics()
        self.accuracy = AccuracyTracker()  # the live predictor's, on /metrics
        self.tick = 0
        self._no_predictor: set[str] = set()  # instances already warned about
        self._no_length: set[str] = set()  # requests already warned about (oracle)
        self.bus: Bus | None = None
        self.leadership: Leadership | None = None
        self._metrics_server: Any = None
        self._collector: SafePointCollector | None = None
        # Open unless a tick runs: report intake waits for the tick (a tick's
        # awaits would otherwise each let a chunk of intake run first).
        self._intake_open = asyncio.Event()
        self._intake_open.set()

    @property
    def origin(self) -> str:
        return f"scheduler:{self.node}"

    async def startup(self) -> None:
        # The planner's numba kernels: compiled (or loaded from the disk cache)
        # now, not on the first tick after READY.
        from star.planner.kernels import warm as warm_planner

        warm_s = warm_planner()
        gc_thresholds = set_gc_gen0_threshold(self.settings.scheduler.gc_gen0_threshold)
        self._collector = SafePointCollector()  # collections after ticks, not inside them
        log.info("planner_kernels_ready", seconds=round(warm_s, 3))
        self.bus = Bus.for_cluster(self.settings, "scheduler")
        await self.bus.retrying("PING", self.bus.redis.ping)
        self.leadership = Leadership(self.bus, self.node, self.settings.scheduler.lock_ttl_s)
        # star_bus_refused_total: entries refused for their signature
        self.metrics.registry.register(RefusalCollector(self.bus.refusals))
        cfg = self.settings.scheduler
        if cfg.metrics_port:
            self._metrics_server = self.metrics.serve(cfg.metrics_host, cfg.metrics_port)
        log.info(
            "scheduler_ready",
            node=self.node,
            mode=cfg.mode,
            interval_s=cfg.interval_s,
            gc_thresholds=list(gc_thresholds),
        )

    async def main(self) -> None:
        self.spawn(self._reports(), "reports")
        self.spawn(self._events(), "events")
        self.spawn(self._decisions(), "decisions")
        self.spawn(self._leader(), "leader")
        self.spawn(self._ticks(), "ticks")
        await self.wait_exit()

    async def cleanup(self) -> None:
        if self.leadership is not None:
            try:
                await self.leadership.resign()
            except Exception as exc:  # Redis gone at shutdown: the TTL frees the lock
                log.warning("leadership_not_resigned", error=str(exc))
        if self._metrics_server is not None:
            self._metrics_server.shutdown()
        if self.bus is not None:
            await self.bus.close()
        if self._collector is not None:
            self._collector.close()

    # -- tasks ---------------------------------------------------------------------

    async def _reports(self) -> None:
        assert self.bus is not None
        cfg = self.settings.scheduler
        # Start the group a staleness window back: a restarted node warms its view.
        start = f"{int((time.time() - cfg.staleness_s) * 1000)}-0"
        reader = GroupReader(
            self.bus, "reports", f"{cfg.group}:{self.node}", self.node, Report, start=start
        )
        # Through a Redis outage of any length the iteration waits (and logs it);
        # meanwhile instances go stale and the planner has nothing to move.
        # Decoded and applied a chunk at a time: a tick or the lock renewal that
        # falls due waits for one chunk, not for a whole batch; none while a tick runs.
        async for entries in reader.chunks(REPORTS_PER_YIELD, self._intake_open):
            now, wall = time.monotonic(), time.time()
            for entry in entries:
                assert isinstance(entry.msg, Report)
                why = self.report_gate.admit(entry.msg, wall)
                if why is not None:
                    report_refusal(log, self.report_gate, why, entry.msg)
                    continue
                if self.view.apply_report(entry.msg, now):
                    log.info("instance_live", instance=entry.msg.instance, role=entry.msg.role)
                self.accuracy.observe(entry.msg)

    async def _events(self) -> None:
        assert self.bus is not None
        # From a staleness window back, like the reports: a worker_down sent
        # just before this node started still outweighs its fresh reports.
        start = f"{int((time.time() - self.settings.scheduler.staleness_s) * 1000)}-0"
        async for entry in Subscriber(self.bus, "events", Event, start=start):
            assert isinstance(entry.msg, Event)
            event = entry.msg
            if event.event is EventKind.WORKER_DOWN and event.instance:
                if self.view.mark_down(event.instance, event.ts):
                    log.warning("instance_down_excluded", instance=event.instance)
            score = self.accuracy.apply_event(event)
            if score is not None:
                self.metrics.predictor_scored(score, self.accuracy)
            resolved = self.view.apply_event(event)
            for instance in self.view.suspected:
                log.warning(
                    "instance_suspected_excluded",
                    instance=instance,
                    migration_id=event.migration,
                    side=event.detail,
                    reason=event.data.get("reason", ""),
                    hint="back with its next report; a dead worker stays out",
                )
            self.view.suspected.clear()
            if resolved is not None:
                decision, outcome = resolved
                self.metrics.decisions.labels(decision.mode, outcome).inc()
                log.info(
                    "migration_resolved",
                    migration_id=decision.id,
                    request_id=decision.request,
                    outcome=outcome,
                )

    async def _decisions(self) -> None:
        """Book every decision on the stream: a standby's view (and manual
        `star migrate` decisions) must count in-flight moves like the leader's."""
        assert self.bus is not None
        gate = DecisionGate(self.settings.scheduler.decision_timeout_s)
        async for entry in Subscriber(self.bus, "decisions", Decision, start="$"):
            decision = entry.msg
            assert isinstance(decision, Decision)
            why = gate.admit(decision, time.time())
            if why is not None:  # a replayed stream books nothing again (star.decisions)
                report_drop(log, gate, why, decision)
            elif decision.id not in self.view.in_flight:
                self.view.book(decision, time.monotonic())

    async def _leader(self) -> None:
        assert self.leadership is not None and self.bus is not None
        ttl = self.settings.scheduler.lock_ttl_s
        while True:
            was = self.leadership.is_leader
            try:
                leader = await self.leadership.step()
            except Exception as exc:  # Redis unreachable: we cannot know; stop publishing
                if was:
                    log.warning("leadership_unknown_stepping_down", error=str(exc))
                self.leadership.demote()
                leader = False
            self.metrics.leader.set(1 if leader else 0)
            if leader and not was:
                await self.bus.publish(
                    "events",
                    Event.now(
                        EventKind.LEADER,
                        self.origin,
                        data={"fence": self.leadership.fence},
                    ),
                )
            await asyncio.sleep(ttl / 3 if leader else ttl / 5)

    async def _ticks(self) -> None:
        interval = self.settings.scheduler.interval_s
        loop = asyncio.get_running_loop()
        next_at = loop.time()
        outage = Outage("tick_cut_short_redis_unreachable", "ticks_reach_redis_again")
        while True:
            started = time.perf_counter()
            self._intake_open.clear()
            try:
                await self.run_tick()
            except REDIS_DOWN as exc:
                # Redis is gone: this tick's publishing is lost (the leader task
                # steps down meanwhile); the next tick plans again.
                outage.down(exc)
            else:
                outage.up()
            finally:
                self._intake_open.set()
            done = time.perf_counter()
            self.metrics.tick_seconds.observe(done - started)
            if self._collector is not None:
                generation = self._collector.collect_due()
                if generation is not None:
                    self.metrics.gc_seconds.labels(str(generation)).observe(
                        time.perf_counter() - done
                    )
            next_at += interval
            now = loop.time()
            if next_at < now:  # overran: skip the missed slots, keep the phase
                skipped = int((now - next_at) // interval) + 1
                next_at += skipped * interval
            await asyncio.sleep(next_at - now)

    def _warn_unknown(self, snapshot: Snapshot) -> None:
        """Say what the mode cannot know: once per instance / request, not per tick."""
        missing = {r.instance for r in self.view.live("decode") if r.predictor is False}
        self.metrics.without_predictor.set(len(missing))
        kind = self.params.mode.kind
        if kind in (ModeKind.PREDICTED, ModeKind.BINS):
            for name in sorted(missing - self._no_predictor):
                log.warning(
                    "instance_without_predictor",
                    hint="its requests have no R-hat and count as endless in this mode; "
                    "load predictor.checkpoint on its worker",
                    instance=name,
                    mode=str(self.params.mode),
                )
        self._no_predictor = missing  # one that loads a predictor and loses it warns again
        if kind is ModeKind.ORACLE:
            unknown = snapshot.unknown_lengths()
            new = sorted(unknown - self._no_length)
            if new:
                log.warning(
                    "oracle_lengths_unknown",
                    hint="send ignore_eos with max_tokens and no stop condition; treated as "
                    "unknown, as a missing prediction in predicted mode",
                    count=len(new),
                    requests=new[:10],
                )
            self._no_length = unknown  # finished ones are forgotten

    async def run_tick(self) -> None:
        """One pass of Algorithm 1's scheduler loop."""
        assert self.bus is not None and self.leadership is not None
        self.tick += 1
        now = time.monotonic()
        started = time.perf_counter()
        leader = self.leadership.is_leader
        for name in self.view.mark_stale(now):
            log.warning("instance_stale_excluded", instance=name, staleness_s=self.view.staleness_s)
            if leader:
                await self.bus.publish(
                    "events",
                    Event.now(EventKind.INSTANCE_STALE, self.origin, instance=name),
                )
        for decision in self.view.expire(now):
            self.metrics.decisions.labels(decision.mode, "expired").inc()
            log.warning("decision_expired", migration_id=decision.id, request_id=decision.request)
            if leader:
                await self.bus.publish(
                    "events",
                    Event.now(
                        EventKind.EXPIRED,
                        self.origin,
                        request=decision.request,
                        migration=decision.id,
                    ),
                )
        snapshot = self.view.snapshot(self.params)
        self.metrics.live_instances.set(len(self.view.live()))
        self._warn_unknown(snapshot)
        viewed = time.perf_counter()
        result = plan_on(snapshot.arrays, snapshot.ids, snapshot.request, self.params)
        planned = time.perf_counter()
        phase = self.metrics.tick_phase_seconds
        phase.labels("view").observe(viewed - started)
        phase.labels("plan").observe(planned - viewed)
        if not leader:
            return
        try:
            await self._publish(result, now)
        finally:
            phase.labels("publish").observe(time.perf_counter() - planned)

    async def _publish(self, result: Plan, now: float) -> None:
        """The leader's part of a tick: each move as a fenced decision, booked
        (at ``now``, monotonic) at once, then the dispatch view."""
        assert self.bus is not None and self.leadership is not None
        mode = str(self.params.mode)
        for move in result.moves:
            decision = decision_for(
                move,
                f"m-{uuid.uuid4().hex[:12]}",
                self.tick,
                mode,
                self.leadership.fence,
                time.time(),
            )
            entry = await self.leadership.publish(decision)
            if entry is None:
                return  # lost the lock: the new leader publishes from now on
            self.view.book(decision, now)
            self.metrics.decisions.labels(mode, "decided").inc()
            log.info(
                "migration_decided",
                migration_id=decision.id,
                request_id=move.request,
                source=move.source,
                target=move.target,
                delta_v=round(move.delta_v, 3),
                reason=move.reason,
                tick=self.tick,
            )
        # After booking, so proxies dispatch against the post-move view.
        await self.bus.publish_load(
            self.view.load_entries(result.workloads, time.time()),
            ttl_s=self.view.staleness_s,
            policy=self.settings.scheduler.dispatch,  # the proxies follow it (proxy.cluster)
        )


async def read_view(settings: Settings) -> ClusterView:
    """The scheduler's view rebuilt from what the bus holds now (``star plan --from-redis``).

    The newest reports and the windows this service reads: ``worker_down``
    events a staleness window back, decisions until they expire and their
    outcomes after them (:func:`scheduler.view.rebuild`). A message that does
    not decode is passed over (a consumer group dead-letters it). Raises
    :class:`BusUnavailable`.
    """

    def decoded(rows: list[tuple[str, dict[bytes, bytes]]]) -> list[Message]:
        out: list[Message] = []
        for _id, raw in rows:
            try:
                out.append(decode(raw.get(b"body", b"")))
            except WireError:
                continue
        return out

    cfg = settings.scheduler
    bus = Bus.for_cluster(settings, "operator")
    try:
        reports = list((await bus.latest_reports()).values())
        window = max(cfg.staleness_s, cfg.decision_timeout_s)
        events = decoded(bus.signed("events", await bus.since("events", window)))
        decisions = decoded(
            bus.signed("decisions", await bus.since("decisions", cfg.decision_timeout_s))
        )
    finally:
        await bus.close()
    return rebuild(
        reports,
        [e for e in events if isinstance(e, Event)],
        [d for d in decisions if isinstance(d, Decision)],
        staleness_s=cfg.staleness_s,
        decision_timeout_s=cfg.decision_timeout_s,
        now=time.monotonic(),
        now_wall=time.time(),
    )
