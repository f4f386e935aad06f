"""AccuracyTracker against the dict-per-request reference it replaced (same scores,
histories, eviction and expiry, to the bit), on random reports and finishes."""

from __future__ import annotations

import math
import random

import pytest

from star.predictor.buckets import PROGRESS_EDGES, index
from star.predictor.live import AccuracyTracker
from star.wire import RequestLoad
from tests.reports import report


class _RefHistory:
    """The tracker's history before it kept columns: a dict, thinned by sorting."""

    def __init__(self, prompt: int, seen: float) -> None:
        self.points: dict[int, float] = {}
        self.prompt, self.next_n, self.stride, self.seen = prompt, 0, 1, seen

    def add(self, tokens: int, remaining: float, max_points: int) -> None:
        self.points[tokens] = remaining
        self.next_n = tokens + self.stride
        if len(self.points) > max_points:
            kept = sorted(self.points)[::2]
            self.points = {n: self.points[n] for n in kept}
            self.stride *= 2
            self.next_n = tokens + self.stride


class _Reference:
    def __init__(self, max_points: int, ttl_s: float, max_requests: int) -> None:
        self.max_points, self.ttl_s, self.max_requests = max_points, ttl_s, max_requests
        self.live: dict[str, _RefHistory] = {}
        self.swept = -math.inf
        self.finished: set[str] = set()
        self.points = [0] * (len(PROGRESS_EDGES))
        self.abs_error = [0.0] * (len(PROGRESS_EDGES))

    def observe(self, requests: list[RequestLoad], now: float) -> None:
        for r in requests:
            if r.predicted_remaining is None:
                continue
            start = r.tokens - r.generated
            h = self.live.get(r.id)
            if h is None:
                if r.id in self.finished:
                    continue
                h = self.live[r.id] = _RefHistory(start, now)
            else:
                h.seen = now
                h.prompt = min(h.prompt, start)
            if r.tokens >= h.next_n and math.isfinite(r.predicted_remaining):
                h.add(r.tokens, float(r.predicted_remaining), self.max_points)
        if len(self.live) > self.max_requests or now - self.swept >= self.ttl_s / 8:
            self.swept = now
            for rid in [rid for rid, h in self.live.items() if h.seen < now - self.ttl_s]:
                del self.live[rid]
            if len(self.live) > self.max_requests:
                keep = self.max_requests - self.max_requests // 10
                by_age = sorted(self.live, key=lambda rid: self.live[rid].seen)
                for rid in by_age[: len(self.live) - keep]:
                    del self.live[rid]

    def finish(self, rid: str, final: int) -> tuple[list[int], list[float]] | None:
        h = self.live.pop(rid, None)
        self.finished.add(rid)
        if h is None or not h.points:
            return None
        points, errors = [0] * len(self.points), [0.0] * len(self.points)
        for tokens, remaining in h.points.items():
            generated = tokens - h.prompt
            if 0 <= generated <= final:
                b = index(generated, PROGRESS_EDGES)
                points[b] += 1
                errors[b] += abs(remaining - (final - generated))
        if not any(points):
            return None
        for b in range(len(points)):
            self.points[b] += points[b]
            self.abs_error[b] += errors[b]
        return points, errors


@pytest.mark.parametrize("seed", range(4))
def test_the_tracker_matches_its_dict_reference_bit_for_bit(seed: int) -> None:
    rng = random.Random(seed)
    max_points, ttl, cap = rng.choice([2, 3, 8, 16]), 40.0, 50
    tracker = AccuracyTracker(max_points=max_points, ttl_s=ttl, max_requests=cap)
    ref = _Reference(max_points, ttl, cap)
    running: dict[str, list[int]] = {}  # id -> [prompt, generated]
    serial = 0
    for step in range(600):
        now = step * 0.7
        while len(running) < 30:
            serial += 1
            running[f"r{serial}"] = [rng.randint(1, 500), rng.randint(0, 3)]
        loads = []
        for rid, state in list(running.items()):
            if rng.random() < 0.3:
                continue  # on another instance this time
            state[1] += rng.randint(0, 9)
            remaining = rng.choice([None, math.inf, rng.uniform(0, 900), float(rng.randint(0, 9))])
            # A migrated request's report may show a shorter prompt than its first.
            prompt = state[0] - (rng.randint(0, 5) if rng.random() < 0.05 else 0)
            loads.append(RequestLoad(rid, prompt + state[1], state[1], remaining))
        tracker.observe(report(requests=loads), now=now)
        ref.observe(loads, now)
        for rid in [rid for rid in running if rng.random() < 0.02]:
            del running[rid]  # its finish is lost: only expiry or the cap forget it
        for rid in [rid for rid in running if rng.random() < 0.04]:
            final = running.pop(rid)[1] + rng.randint(-3, 20)
            score = tracker.finish(rid, max(final, 0))
            expected = ref.finish(rid, max(final, 0))
            got = None if score is None else (list(score.points), list(score.abs_error))
            assert got == expected
        assert list(tracker._live) == list(ref.live)  # same requests, same order
        for rid, h in ref.live.items():
            assert tracker.history(rid) == h.points
            assert list(tracker.history(rid)) == list(h.points)
    assert tracker.points == ref.points and tracker.abs_error == ref.abs_error
    assert tracker.requests > 20 and tracker.forgotten > 0 and tracker.dropped_points > 0


def test_a_token_count_past_int64_is_kept_as_it_is() -> None:
    t = AccuracyTracker(max_points=4)
    big = 2**70
    for g in range(0, 60, 10):
        t.observe(report(requests=[RequestLoad("r", big + g, g, 100.0 - g)]), now=float(g))
    assert t.history("r") == {big: 100.0, big + 20: 80.0, big + 40: 60.0, big + 50: 50.0}
    score = t.finish("r", 100, prompt_tokens=big)
    assert score is not None and score.total_points == 4 and sum(score.abs_error) == 0.0
