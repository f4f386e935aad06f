"""The live length predictor's accuracy, scored against how requests really ended.

:class:`AccuracyTracker` keeps the R-hat points the decode workers reported
per running request and, when the proxy's ``finished`` event gives the true
length, scores them in the progress buckets of ``star predictor eval``; the
scheduler exports the MAE on ``/metrics``. :func:`replay` does the same
offline. Pure (``now`` comes from the reports unless given). How progress is
counted across migrations and which requests are scored: ``docs/predictor.md``.
"""

from __future__ import annotations

import math
from array import array
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from star.predictor.buckets import PROGRESS_EDGES, index, ranges
from star.wire import Event, EventKind, Report

BUCKETS: tuple[str, ...] = tuple(label for _lo, _hi, label in ranges(PROGRESS_EDGES))
"""Progress bucket labels, as ``star predictor eval`` names them (without "progress ")."""

SCORED_REASONS = frozenset({"stop", "length"})
MAX_POINTS = 256
"""Points kept per request; past it the history is thinned evenly (every other point)."""
TTL_S = 600.0
"""A request unseen in reports for this long is forgotten (its finish was lost)."""
MAX_REQUESTS = 100_000
RECENTLY_FINISHED = 4096
"""Finished ids remembered, so a report that lags the ``finished`` event starts no history."""


class _History:
    """A running request's kept points, as two columns in the order they were added.

    A point is kept only at ``tokens >= next_n`` and ``next_n`` is past the
    last one, so N increases along the columns: the order ``sorted`` gives.
    Plain arrays: no Python object (nor dict entry) per point.
    """

    __slots__ = ("next_n", "prompt", "remaining", "seen", "stride", "tokens")

    def __init__(self, prompt: int, seen: float) -> None:
        self.tokens: array[int] | list[int] = array("q")  # N of each point (list: not int64)
        self.remaining = array("d")  # R-hat of each point
        self.prompt = prompt  # smallest tokens - generated seen: the original prompt
        self.next_n = 0  # smallest N the next kept point may have
        self.stride = 1  # minimum N step between kept points (doubles on each thinning)
        self.seen = seen

    @property
    def points(self) -> dict[int, float]:
        """N (tokens) -> R-hat, in increasing N."""
        return dict(zip(self.tokens, self.remaining, strict=True))

    def add(self, tokens: int, remaining: float, max_points: int) -> None:
        try:
            self.tokens.append(tokens)
        except (OverflowError, TypeError):  # not an int64: keep the values as they are
            self.tokens = [*self.tokens, tokens]
        self.remaining.append(remaining)
        self.next_n = tokens + self.stride
        if len(self.tokens) > max_points:
            self.tokens = self.tokens[::2]
            self.remaining = self.remaining[::2]
            self.stride *= 2
            self.next_n = tokens + self.stride


@dataclass(frozen=True, slots=True)
class Score:
    """One finished request's contribution: points and summed |error| per bucket."""

    request: str
    points: tuple[int, ...]
    abs_error: tuple[float, ...]

    @property
    def total_points(self) -> int:
        return sum(self.points)


class AccuracyTracker:
    """Per-request R-hat histories in, MAE by progress bucket out.

    Memory is bounded: at most ``max_points`` points per request and
    ``max_requests`` requests (the least recently seen go first), and a
    request unseen for ``ttl_s`` is dropped. ``ttl_s`` / ``max_requests``
    None: never (offline replay).
    """

    def __init__(
        self,
        *,
        max_points: int = MAX_POINTS,
        ttl_s: float | None = TTL_S,
        max_requests: int | None = MAX_REQUESTS,
    ) -> None:
        if max_points < 2:
            raise ValueError(f"max_points must be at least 2, got {max_points}")
        self.max_points = max_points
        self.ttl_s = ttl_s
        self.max_requests = max_requests
        self._live: dict[str, _History] = {}
        self._swept = -math.inf  # when expire() last ran
        self._finished: OrderedDict[str, None] = OrderedDict()
        self.points = [0] * len(BUCKETS)
        self.abs_error = [0.0] * len(BUCKETS)
        self.requests = 0
        self.skipped: dict[str, int] = {"abnormal": 0, "no_prediction": 0}
        self.dropped_points = 0  # inconsistent with the final length
        self.forgotten = 0  # expired or evicted unfinished

    def __len__(self) -> int:
        """Requests being tracked."""
        return len(self._live)

    def history(self, request_id: str) -> dict[int, float]:
        """The kept points of a running request: N (tokens) -> R-hat (a copy)."""
        h = self._live.get(request_id)
        return h.points if h is not None else {}

    def observe(self, report: Report, now: float | None = None) -> None:
        """Record the R-hat of every running request of a decode worker's report."""
        if report.role != "decode":
            return
        now = report.ts if now is None else now
        live, max_points, finished = self._live, self.max_points, self._finished
        isfinite = math.isfinite
        # The scheduler calls this for every report: a few dict operations per
        # request, no reordering (expiry is a periodic sweep), _History.add inlined
        # but for a thinning.
        for r in report.requests:
            remaining = r.predicted_remaining
            if remaining is None:
                continue
            tokens = r.tokens
            start = tokens - r.generated
            rid = r.id
            h = live.get(rid)
            if h is None:
                if rid in finished:
                    continue
                h = live[rid] = _History(start, now)
            else:
                h.seen = now
                if start < h.prompt:
                    h.prompt = start
            if tokens >= h.next_n and isfinite(remaining):
                points = h.tokens
                if (
                    len(points) >= max_points
                    or type(points) is not array
                    or type(tokens) is not int
                ):
                    h.add(tokens, float(remaining), max_points)
                    continue
                try:
                    points.append(tokens)
                except OverflowError:  # past int64: add() switches to a list
                    h.add(tokens, float(remaining), max_points)
                    continue
                h.remaining.append(remaining)
                h.next_n = tokens + h.stride
        over = self.max_requests is not None and len(live) > self.max_requests
        if over or (self.ttl_s is not None and now - self._swept >= self.ttl_s / 8):
            self.expire(now)

    def expire(self, now: float) -> int:
        """Forget requests unseen since ``now - ttl_s``, then the least recently seen
        past ``max_requests`` (down to 90 % of it, so a full tracker sweeps rarely)."""
        self._swept = now
        live = self._live
        before = len(live)
        if self.ttl_s is not None:
            cutoff = now - self.ttl_s
            for rid in [rid for rid, h in live.items() if h.seen < cutoff]:
                del live[rid]
        if self.max_requests is not None and len(live) > self.max_requests:
            keep = self.max_requests - self.max_requests // 10
            by_age = sorted(live, key=lambda rid: live[rid].seen)
            for rid in by_age[: len(live) - keep]:
                del live[rid]
        n = before - len(live)
        self.forgotten += n
        return n

    def discard(self, request_id: str) -> None:
        """Forget a request without scoring it (aborted, failed)."""
        if self._live.pop(request_id, None) is not None:
            self.skipped["abnormal"] += 1
        self._remember(request_id)

    def finish(
        self, request_id: str, final_generated: int, prompt_tokens: int | None = None
    ) -> Score | None:
        """Score a request that ended naturally after ``final_generated`` tokens in all.

        ``prompt_tokens``: its original prompt length (None: inferred from the
        reports). Returns its contribution, None when it had no prediction.
        """
        h = self._live.pop(request_id, None)
        self._remember(request_id)
        if h is None or not h.tokens:
            self.skipped["no_prediction"] += 1
            return None
        prompt = prompt_tokens if prompt_tokens is not None else h.prompt
        points = [0] * len(BUCKETS)
        errors = [0.0] * len(BUCKETS)
        for tokens, remaining in zip(h.tokens, h.remaining, strict=True):
            generated = tokens - prompt
            if generated < 0 or generated > final_generated:
                self.dropped_points += 1
                continue
            b = index(generated, PROGRESS_EDGES)
            points[b] += 1
            errors[b] += abs(remaining - (final_generated - generated))
        if not any(points):
            self.skipped["no_prediction"] += 1
            return None
        self.requests += 1
        for b in range(len(BUCKETS)):
            self.points[b] += points[b]
            self.abs_error[b] += errors[b]
        return Score(request_id, tuple(points), tuple(errors))

    def apply_event(self, event: Event) -> Score | None:
        """Act on a ``finished`` event (others are ignored): score it or discard it."""
        if event.event is not EventKind.FINISHED or not event.request:
            return None
        generated = _count(event.data.get("generated"))
        if event.detail not in SCORED_REASONS or generated is None:
            self.discard(event.request)
            return None
        return self.finish(event.request, generated, _count(event.data.get("prompt_tokens")))

    def mae(self, bucket: str | None = None) -> float | None:
        """MAE (tokens) in one bucket, or over all points; None without points."""
        if bucket is None:
            n, err = sum(self.points), sum(self.abs_error)
        else:
            b = BUCKETS.index(bucket)
            n, err = self.points[b], self.abs_error[b]
        return err / n if n else None

    def summary(self) -> dict[str, Any]:
        """JSON-friendly totals: MAE and points per progress bucket and overall."""
        return {
            "requests": self.requests,
            "points": sum(self.points),
            "mae": self.mae(),
            "buckets": [
                {"bucket": label, "points": self.points[b], "mae": self.mae(label)}
                for b, label in enumerate(BUCKETS)
            ],
            "skipped": dict(self.skipped),
            "dropped_points": self.dropped_points,
            "running": len(self._live),
        }

    def _remember(self, request_id: str) -> None:
        self._finished[request_id] = None
        self._finished.move_to_end(request_id)
        if len(self._finished) > RECENTLY_FINISHED:
            self._finished.popitem(last=False)


def _count(value: Any) -> int | None:
    """A token count from an event's data (None: absent or not a count)."""
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    return None


def replay(
    reports: Iterable[Report], events: Iterable[Event], *, max_points: int = MAX_POINTS
) -> dict[str, Any]:
    """The live accuracy of a finished run, from its reports and events (any order
    within each): every report first, then every ``finished`` event. Returns
    :meth:`AccuracyTracker.summary`."""
    tracker = AccuracyTracker(max_points=max_points, ttl_s=None, max_requests=None)
    for report in reports:
        tracker.observe(report)
    for event in events:
        tracker.apply_event(event)
    return tracker.summary()
