"""The live predictor accuracy tracker (star.predictor.live): table tests, no IO."""

from __future__ import annotations

import json

import pytest

from star.predictor.buckets import PROGRESS_EDGES, index, ranges
from star.predictor.live import BUCKETS, AccuracyTracker, replay
from star.wire import Event, EventKind, RequestLoad
from tests.reports import report

PROMPT = 30


def load(rid: str, generated: int, remaining: float | None, prompt: int = PROMPT) -> RequestLoad:
    """A request as a decode worker reports it: N = prompt + generated."""
    return RequestLoad(rid, prompt + generated, generated, remaining)


def finished(rid: str, generated: int, reason: str = "stop", prompt: int | None = PROMPT) -> Event:
    data: dict[str, object] = {"generated": generated, "migrations": 0, "recoveries": 0}
    if prompt is not None:
        data["prompt_tokens"] = prompt
    return Event(EventKind.FINISHED, 0.0, "proxy:p", request=rid, detail=reason, data=data)


def feed(
    tracker: AccuracyTracker, final: int, err: float = 0.0, every: int = 10, rid: str = "r"
) -> None:
    """Reports every ``every`` tokens of one request whose R-hat is off by ``err``."""
    for g in range(0, final, every):
        tracker.observe(report(requests=[load(rid, g, final - g + err)]), now=float(g))


def by_bucket(summary: dict[str, object]) -> dict[str, tuple[int, float | None]]:
    rows = summary["buckets"]
    assert isinstance(rows, list)
    return {row["bucket"]: (row["points"], row["mae"]) for row in rows}


def test_buckets_are_star_predictor_evals() -> None:
    assert BUCKETS == ("0", "1-49", "50-99", "100-199", "200-399", "400+")
    assert [lo for lo, _hi, _label in ranges(PROGRESS_EDGES)] == list(PROGRESS_EDGES)
    values = (0, 1, 49, 50, 399, 400, 10_000)
    assert [index(v, PROGRESS_EDGES) for v in values] == [0, 1, 1, 2, 4, 5, 5]


def test_a_perfect_predictor_scores_zero_in_every_bucket_it_reaches() -> None:
    t = AccuracyTracker()
    feed(t, 500)
    score = t.apply_event(finished("r", 500))
    assert score is not None and score.total_points == 50
    s = t.summary()
    assert s["requests"] == 1 and s["points"] == 50 and s["mae"] == 0.0
    assert by_bucket(s) == {
        "0": (1, 0.0),
        "1-49": (4, 0.0),
        "50-99": (5, 0.0),
        "100-199": (10, 0.0),
        "200-399": (20, 0.0),
        "400+": (10, 0.0),
    }
    assert len(t) == 0
    json.dumps(s)  # JSON-friendly: no NaN, no tuples of dataclasses


@pytest.mark.parametrize(
    ("final", "err", "bucket", "points"),
    [
        (1, 7.0, "0", 1),  # one report, before the first token
        (40, -12.0, "1-49", 3),  # generated 10, 20, 30 (and 0)
        (450, 25.0, "400+", 5),  # generated 400..440
    ],
)
def test_a_constant_error_scores_that_constant_in_its_bucket(
    final: int, err: float, bucket: str, points: int
) -> None:
    t = AccuracyTracker()
    feed(t, final, err=err)
    t.apply_event(finished("r", final))
    assert t.mae(bucket) == pytest.approx(abs(err))
    assert t.mae() == pytest.approx(abs(err))
    assert by_bucket(t.summary())[bucket][0] == points


def test_errors_are_absolute_and_averaged_per_point() -> None:
    t = AccuracyTracker()
    t.observe(report(requests=[load("r", 100, 90.0)]))  # truth 100: error 10
    t.observe(report(requests=[load("r", 150, 80.0)]))  # truth 50: error 30
    t.apply_event(finished("r", 200))
    assert t.mae("100-199") == pytest.approx(20.0)
    assert t.mae("0") is None


@pytest.mark.parametrize("reason", ["abort", "aborted", "error"])
def test_requests_that_did_not_end_naturally_are_not_scored(reason: str) -> None:
    t = AccuracyTracker()
    feed(t, 100, err=5.0)
    assert t.apply_event(finished("r", 60, reason=reason)) is None
    s = t.summary()
    assert s["requests"] == 0 and s["points"] == 0 and s["mae"] is None
    assert s["skipped"] == {"abnormal": 1, "no_prediction": 0}
    assert len(t) == 0


def test_length_capped_requests_are_scored() -> None:
    # max_tokens reached (ignore_eos or not): the planner saw these R-hat too.
    t = AccuracyTracker()
    feed(t, 100, err=3.0)
    assert t.apply_event(finished("r", 100, reason="length")) is not None
    assert t.mae() == pytest.approx(3.0)


def test_requests_without_a_prediction_are_not_scored() -> None:
    t = AccuracyTracker()
    for g in (0, 10, 20):
        t.observe(report(requests=[load("r", g, None)]))
    assert t.apply_event(finished("r", 30)) is None
    assert t.apply_event(finished("never-seen", 30)) is None
    s = t.summary()
    assert s["requests"] == 0 and s["skipped"]["no_prediction"] == 2


def test_prefill_reports_and_other_events_are_ignored() -> None:
    t = AccuracyTracker()
    t.observe(report("prefill-0", role="prefill", requests=[load("r-p", 0, 50.0)]))
    assert len(t) == 0
    feed(t, 50)
    other = Event(EventKind.RESUMED, 0.0, "proxy:p", request="r")
    assert t.apply_event(other) is None and len(t) == 1


def test_a_migrated_request_is_scored_from_its_original_start() -> None:
    # 100 tokens on "a", then continued on "b": the continuation's prompt holds
    # those 100 tokens and b's generated restarts at 0, its N does not.
    final, moved = 300, 100
    t = AccuracyTracker()
    for g in range(0, moved, 20):
        t.observe(report("a", requests=[load("r", g, final - g)]))
    for g in range(moved, final, 20):
        local = g - moved
        t.observe(report("b", requests=[load("r", local, final - g, prompt=PROMPT + moved)]))
    score = t.apply_event(finished("r", final))
    assert score is not None and score.total_points == 15
    assert t.mae() == 0.0
    assert by_bucket(t.summary())["200-399"] == (5, 0.0)  # generated 200..280 in all

    # Without prompt_tokens on the event, the first leg's reports give the prompt.
    t2 = AccuracyTracker()
    t2.observe(report("a", requests=[load("r", 40, final - 40)]))
    t2.observe(report("b", requests=[load("r", 60, final - 160, prompt=PROMPT + moved)]))
    t2.apply_event(finished("r", final, prompt=None))
    assert t2.mae() == 0.0
    assert by_bucket(t2.summary())["100-199"] == (1, 0.0)


def test_a_report_lagging_the_finish_starts_no_history() -> None:
    t = AccuracyTracker()
    feed(t, 50)
    t.apply_event(finished("r", 50))
    t.observe(report(requests=[load("r", 45, 5.0)]))
    assert len(t) == 0


def test_points_per_request_are_bounded_and_spread_over_the_request() -> None:
    t = AccuracyTracker(max_points=16)
    feed(t, 2000, every=1)
    kept = sorted(t.history("r"))
    assert len(kept) <= 16
    assert kept[0] == PROMPT and kept[-1] - PROMPT >= 1800  # first and late progress both kept
    t.apply_event(finished("r", 2000))
    assert t.summary()["points"] == len(kept) and t.mae() == 0.0


def test_requests_unseen_for_ttl_or_past_the_cap_are_forgotten() -> None:
    t = AccuracyTracker(ttl_s=60.0, max_requests=3)
    t.observe(report(requests=[load("old", 0, 10.0)]), now=0.0)
    t.observe(report(requests=[load("new", 0, 10.0)]), now=100.0)
    assert len(t) == 1 and t.history("old") == {}
    for i in range(5):
        t.observe(report(requests=[load(f"x{i}", 0, 10.0)]), now=101.0 + i)
    assert len(t) == 3 and set(t.history("x4")) == {PROMPT}
    assert t.forgotten == 4  # "old", then "new", x0 and x1 over the cap
    # A bounded history whatever the request count: a finish after forgetting scores nothing.
    assert t.apply_event(finished("old", 10)) is None


def test_replay_scores_a_run_from_its_reports_and_events() -> None:
    reports = [
        report("a", requests=[load("r1", g, 100 - g + 4.0), load("r2", g, 80.0)])
        for g in range(0, 60, 10)
    ]
    events = [
        Event(EventKind.DISPATCHED, 0.0, "proxy:p", request="r1", instance="a"),
        finished("r1", 100),
        finished("r2", 60, reason="abort"),
    ]
    s = replay(reports, events)
    assert s["requests"] == 1 and s["points"] == 6 and s["mae"] == pytest.approx(4.0)
    assert s["skipped"]["abnormal"] == 1 and s["running"] == 0
    assert by_bucket(s)["50-99"] == (1, pytest.approx(4.0))
