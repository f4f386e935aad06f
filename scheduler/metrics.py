"""Prometheus metrics of the scheduler (its own registry, served on /metrics)."""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from star.predictor.live import BUCKETS, AccuracyTracker, Score

TICK_BUCKETS = (
    0.0005, 0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05,
    0.06, 0.075, 0.1, 0.125, 0.15, 0.2, 0.25, 0.35, 0.5, 0.75, 1.0, 2.5,
)  # fmt: skip


class SchedulerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.tick_seconds = Histogram(
            "star_scheduler_tick_seconds",
            "Time of one scheduler tick (planner + publishing)",
            # Fine enough around the 100 ms target for p50/p99 by interpolation
            # (star bench scheduler reads them).
            buckets=TICK_BUCKETS,
            registry=self.registry,
        )
        self.tick_phase_seconds = Histogram(
            "star_scheduler_tick_phase_seconds",
            "Time of one tick's phase: view (stale, expired, snapshot), plan, publish (decisions, load view)",
            ["phase"],
            buckets=TICK_BUCKETS,
            registry=self.registry,
        )
        self.gc_seconds = Histogram(
            "star_scheduler_gc_seconds",
            "Garbage collections, run right after a tick (star.process.SafePointCollector), by generation",
            ["generation"],
            buckets=TICK_BUCKETS,
            registry=self.registry,
        )
        self.decisions = Counter(
            "star_scheduler_decisions",
            "Migration decisions by mode and outcome (decided, completed, aborted, refused, expired, finished)",
            ["mode", "outcome"],
            registry=self.registry,
        )
        self.live_instances = Gauge(
            "star_scheduler_live_instances", "Instances whose reports are fresh", registry=self.registry
        )
        self.without_predictor = Gauge(
            "star_scheduler_instances_without_predictor",
            "Live decode instances whose reports say no length predictor is loaded (their R-hat is unknown)",
            registry=self.registry,
        )
        self.leader = Gauge("star_scheduler_leader", "1 if this node is the leader", registry=self.registry)
        # The live length predictor's accuracy (star.predictor.live), by tokens generated.
        self.predictor_mae = Gauge(
            "star_predictor_live_mae_tokens",
            "MAE of the reported R-hat against the true remaining length, finished requests since start",
            ["bucket"],
            registry=self.registry,
        )
        self.predictor_points = Counter(
            "star_predictor_live_points",
            "Reported R-hat points scored at their request's finish",
            ["bucket"],
            registry=self.registry,
        )
        self.predictor_abs_error = Counter(
            "star_predictor_live_abs_error_tokens",
            "Summed |R-hat - true remaining| of the scored points (rate / points rate = windowed MAE)",
            ["bucket"],
            registry=self.registry,
        )
        self.predictor_requests = Counter(
            "star_predictor_live_requests",
            "Finished requests whose R-hat history was scored",
            registry=self.registry,
        )

    def predictor_scored(self, score: Score, tracker: AccuracyTracker) -> None:
        """Count one scored request and refresh the MAE gauges from the tracker's totals."""
        self.predictor_requests.inc()
        for b, label in enumerate(BUCKETS):
            if score.points[b]:
                self.predictor_points.labels(label).inc(score.points[b])
                self.predictor_abs_error.labels(label).inc(score.abs_error[b])
            mae = tracker.mae(label)
            if mae is not None:
                self.predictor_mae.labels(label).set(mae)
        overall = tracker.mae()
        if overall is not None:
            self.predictor_mae.labels("all").set(overall)

    def serve(self, host: str, port: int) -> Any:
        """Start the /metrics HTTP server (a daemon thread); returns the server."""
        server, _thread = start_http_server(port, addr=host, registry=self.registry)
        return server
