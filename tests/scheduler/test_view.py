"""ClusterView: staleness, booking, outcomes, expiry (sans-IO, table style)."""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import msgspec
import pytest

from scheduler.view import ClusterView, rebuild, to_request
from star.planner import plan
from star.planner.types import Mode, PlannerParams, Request
from star.wire import Decision, Event, EventKind, Report, RequestLoad
from tests.scheduler.reports import report

P = PlannerParams()


def view() -> ClusterView:
    return ClusterView(staleness_s=3.0, decision_timeout_s=10.0)


def decision(
    mid: str = "m1", request: str = "a-r0", source: str = "a", target: str = "b"
) -> Decision:
    return Decision(mid, request, source, target, 1, -5.0, "current", time.time())


def test_stale_instances_are_excluded_until_they_report_again() -> None:
    v = view()
    assert v.apply_report(report("a", [10]), now=0.0) is True
    assert v.apply_report(report("b", [10]), now=0.0) is True
    assert v.mark_stale(now=2.0) == []
    v.apply_report(report("b", [10], seq=2), now=2.5)
    assert v.mark_stale(now=3.5) == ["a"]
    assert v.mark_stale(now=3.6) == []  # reported once
    assert [i.id for i in v.instances(P)] == ["b"]
    assert v.apply_report(report("a", [10], seq=2), now=4.0) is True  # revived
    assert sorted(i.id for i in v.instances(P)) == ["a", "b"]


def test_late_old_report_is_ignored() -> None:
    v = view()
    v.apply_report(report("a", [10, 20], seq=5), now=0.0)
    late = msgspec.structs.replace(report("a", [1], seq=4), ts=0.0)  # a reclaimed, older entry
    v.apply_report(late, now=1.0)
    assert v.seen["a"].report.seq == 5


def test_prefill_reports_are_not_planner_instances() -> None:
    v = view()
    v.apply_report(report("p", [5], role="prefill"), 0.0)
    v.apply_report(report("d", [5]), 0.0)
    assert [i.id for i in v.instances(P)] == ["d"]
    assert sorted(e.instance for e in v.load_entries({}, 0.0)) == ["d", "p"]


def test_booked_move_counts_on_target_and_marks_both_in_flight() -> None:
    v = view()
    v.apply_report(report("a", [1000, 200]), 0.0)
    v.apply_report(report("b", [50]), 0.0)
    v.apply_report(report("c", [60]), 0.0)
    v.book(decision(), now=0.0)
    by = {i.id: i for i in v.instances(P)}
    assert [r.id for r in by["a"].requests] == ["a-r1"]
    assert {r.id for r in by["b"].requests} == {"a-r0", "b-r0"}
    moved = next(r for r in by["b"].requests if r.id == "a-r0")
    assert moved.tokens == 1000 and moved.migratable is False
    assert by["a"].in_flight and by["b"].in_flight and not by["c"].in_flight
    loads = {e.instance: e.tokens for e in v.load_entries({}, 0.0)}
    assert loads == {"a": 200, "b": 1050, "c": 60}


def test_rows_are_the_reports_requests_converted_and_bystanders_keep_theirs() -> None:
    v = view()
    v.apply_report(report("a", [1000, 200], in_flight=["a-r1"]), 0.0)
    v.apply_report(report("b", [50]), 0.0)
    c = report("c", [60])
    c.requests.append(msgspec.structs.replace(c.requests[0], id="a-r0", tokens=70))  # same id
    v.apply_report(c, 0.0)
    first = {i.id: i for i in v.instances(P)}
    r1 = first["a"].requests[1]
    assert (r1.id, r1.tokens, r1.generated, r1.predicted_remaining) == ("a-r1", 200, 100, 5000.0)
    assert r1.migratable is False and first["a"].busy == {"a-r1"}  # the worker lists it in flight
    assert first["a"].requests[0].migratable is True
    v.book(decision(), now=0.0)  # a-r0: a -> b
    by = {i.id: i for i in v.instances(P)}
    assert [r.id for r in by["a"].requests] == ["a-r1"] and by["a"].busy == {"a-r1"}
    assert [r.id for r in by["b"].requests] == ["a-r0", "b-r0"] and by["b"].busy == {"a-r0"}
    assert by["c"].requests == first["c"].requests  # not a party to the move: untouched
    assert [r.tokens for r in by["c"].requests] == [60, 70] and not by["c"].in_flight


def test_target_report_that_already_has_the_request_is_not_double_counted() -> None:
    v = view()
    v.apply_report(report("a", [1000]), 0.0)
    v.apply_report(report("b", [50]), 0.0)
    v.book(decision(), now=0.0)
    b2 = report("b", [50], seq=2)
    b2.requests.append(type(b2.requests[0])("a-r0", 1001, 501, 10.0))
    v.apply_report(b2, 0.5)
    by = {i.id: i for i in v.instances(P)}
    assert sorted(r.id for r in by["b"].requests) == ["a-r0", "b-r0"]


def test_outcome_events_resolve_and_unknown_ones_are_ignored() -> None:
    v = view()
    v.apply_report(report("a", [100]), 0.0)
    v.book(decision("m1"), 0.0)
    v.book(decision("m2", request="a-r9"), 0.0)
    assert v.apply_event(Event(EventKind.RELEASED, 0.0, "a", migration="m1")) is None
    assert v.apply_event(Event(EventKind.RESUMED, 0.0, "proxy", migration="nope")) is None
    got = v.apply_event(Event(EventKind.RESUMED, 0.0, "proxy", migration="m1"))
    assert got is not None and got[0].id == "m1" and got[1] == "completed"
    got = v.apply_event(Event(EventKind.FINISHED, 0.0, "proxy", request="a-r9"))
    assert got is not None and got[1] == "finished"
    assert v.in_flight == {}


def test_a_resumed_move_stays_off_its_source_until_the_source_reports_again() -> None:
    v = view()
    a1 = msgspec.structs.replace(report("a", [1000, 200]), ts=100.0)
    v.apply_report(a1, 0.0)
    v.apply_report(msgspec.structs.replace(report("b", [50]), ts=100.0), 0.0)
    v.apply_report(msgspec.structs.replace(report("c", [60]), ts=100.0), 0.0)
    v.book(decision(), now=0.0)
    got = v.apply_event(Event(EventKind.RESUMED, 100.5, "proxy", request="a-r0", migration="m1"))
    assert got is not None and got[1] == "completed"
    # a's last report (sent before the release) still lists a-r0: the planner must
    # not see it there, or it moves the request from where it no longer is.
    by = {i.id: i for i in v.instances(P)}
    assert [r.id for r in by["a"].requests] == ["a-r1"]
    assert {r.id for r in by["b"].requests} == {"a-r0", "b-r0"}
    assert not any(i.in_flight for i in by.values())  # the move is over: both free
    assert {e.instance: e.tokens for e in v.load_entries({}, 0.0)} == {
        "a": 200,
        "b": 1050,
        "c": 60,
    }
    # Nothing to move but a-r0 from a: no plan may name it (the bug: a decision
    # a -> b for a request already on b, refused by the proxy).
    planned = plan(v.instances(P), dataclasses.replace(P, mode=Mode.parse("current")))
    assert all(m.request != "a-r0" for m in planned.moves)
    # b reports it: b's own row; a reports after the resume: the move is settled.
    b2 = msgspec.structs.replace(report("b", [50], seq=2), ts=100.6, used_tokens=1051)
    b2.requests.append(type(b2.requests[0])("a-r0", 1001, 501, 10.0))
    v.apply_report(b2, 0.6)
    assert {e.instance: e.tokens for e in v.load_entries({}, 0.0)}["b"] == 1051
    assert v.settling
    v.apply_report(msgspec.structs.replace(report("a", [200], seq=2), ts=100.7), 0.7)
    assert v.settling == {}


def test_a_settling_move_ends_with_its_request_or_its_deadline() -> None:
    v = view()
    v.apply_report(msgspec.structs.replace(report("a", [1000]), ts=100.0), 0.0)
    v.book(decision(), now=0.0)
    v.apply_event(Event(EventKind.RESUMED, 100.5, "proxy", request="a-r0", migration="m1"))
    v.apply_event(Event(EventKind.FINISHED, 101.0, "proxy", request="a-r0"))
    assert v.settling == {}
    v.book(decision("m2", request="a-r0"), now=1.0)
    v.apply_event(Event(EventKind.RESUMED, 101.5, "proxy", request="a-r0", migration="m2"))
    assert v.settling and v.expire(now=10.9) == []
    assert v.expire(now=11.0) == [] and v.settling == {}  # a clock skew holds it no longer
    # A source that already reported after the resume settles nothing.
    v.apply_report(msgspec.structs.replace(report("a", [1000], seq=2), ts=103.0), 2.0)
    v.book(decision("m3", request="a-r0"), now=2.0)
    v.apply_event(Event(EventKind.RESUMED, 102.5, "proxy", request="a-r0", migration="m3"))
    assert v.settling == {}


def test_decisions_without_outcome_expire() -> None:
    v = view()
    v.book(decision("m1"), now=0.0)
    assert v.expire(now=9.9) == []
    assert [d.id for d in v.expire(now=10.0)] == ["m1"]
    assert v.in_flight == {}


def test_worker_trace_used_only_when_on_the_planner_grid_and_nothing_booked() -> None:
    v = view()
    r = report("a", [100])
    r.trace.extend([100.0 + 32 * j for j in range(P.horizon + 1)])
    v.apply_report(r, 0.0)
    v.apply_report(report("b", [10]), 0.0)
    by = {i.id: i for i in v.instances(P)}
    assert by["a"].trace is not None and len(by["a"].trace) == P.horizon + 1
    assert by["b"].trace is None  # empty trace: the planner computes it
    v.book(decision(), 0.0)
    assert {i.id: i for i in v.instances(P)}["a"].trace is None


def at(r: Report, ts: float) -> Report:
    return msgspec.structs.replace(r, ts=ts)


# (steps, live decode instances after them). Steps: ("report", instance, seq,
# ts) or ("down", instance, ts); reports all arrive at now=0 (fresh).
DOWN_CASES = [
    pytest.param(
        [("report", "a", 1, 100.0), ("report", "b", 1, 100.0)], ["a", "b"], id="both live"
    ),
    pytest.param(
        [("report", "a", 1, 100.0), ("report", "b", 1, 100.0), ("down", "b", 101.0)],
        ["a"],
        id="down drops a fresh instance",
    ),
    pytest.param(
        [
            ("report", "a", 1, 100.0),
            ("report", "b", 1, 100.0),
            ("down", "b", 101.0),
            ("report", "b", 2, 100.5),
        ],
        ["a"],
        id="a report sent before the down, read late, does not revive",
    ),
    pytest.param(
        [("report", "a", 1, 100.0), ("down", "b", 101.0), ("report", "b", 7, 100.9)],
        ["a"],
        id="down read before the instance's last report",
    ),
    pytest.param(
        [
            ("report", "a", 1, 100.0),
            ("report", "b", 9, 100.0),
            ("down", "b", 101.0),
            ("report", "b", 1, 102.0),
        ],
        ["a", "b"],
        id="a restarted worker of the same name reports again",
    ),
    pytest.param(
        [("report", "a", 1, 100.0), ("down", "c", 101.0)],
        ["a"],
        id="down of an unknown instance",
    ),
]


@pytest.mark.parametrize(("steps", "live"), DOWN_CASES)
def test_worker_down_excludes_an_instance_until_it_reports_again(
    steps: list[tuple[Any, ...]], live: list[str]
) -> None:
    v = view()
    for step in steps:
        if step[0] == "report":
            _, name, seq, ts = step
            v.apply_report(at(report(name, [100 * seq], seq=seq), ts), now=0.0)
        else:
            _, name, ts = step
            v.mark_down(name, ts)
    assert v.mark_stale(now=0.5) == []  # every report is fresh: only a down excludes
    assert sorted(i.id for i in v.instances(P)) == live
    assert sorted(e.instance for e in v.load_entries({}, 0.0)) == live


def test_worker_down_reports_whether_it_excluded_a_live_instance() -> None:
    v = view()
    v.apply_report(report("a", [10]), now=0.0)
    v.apply_report(report("b", [10]), now=0.0)
    assert v.mark_down("b", time.time() + 1) is True
    assert v.mark_down("b", time.time() + 1) is False  # already down
    assert v.mark_down("x", time.time()) is False  # never seen
    assert v.apply_report(report("b", [10], seq=2), now=0.5) is False  # sent before the down
    assert v.apply_report(at(report("b", [10], seq=3), time.time() + 2), now=0.6) is True  # back


def test_a_down_instance_is_neither_source_nor_target() -> None:
    """The planner would move a request from "a" to the idle "b"; "b" is down,
    so the only target left is "c", and once "a" is down there is no source."""
    params = PlannerParams(mode=Mode.parse("current"))
    v = view()
    v.apply_report(report("a", [4000, 3000, 2500]), now=0.0)
    v.apply_report(report("b", [10]), now=0.0)
    assert {m.target for m in plan(v.instances(params), params).moves} == {"b"}
    v.mark_down("b", time.time() + 1)
    assert not plan(v.instances(params), params).moves  # "a" alone: nothing to balance
    v.apply_report(report("c", [300]), now=0.1)
    moves = plan(v.instances(params), params).moves
    assert [(m.source, m.target) for m in moves] == [("a", "c")]
    v.mark_down("a", time.time() + 1)
    assert not plan(v.instances(params), params).moves


# (the ABORTED event's detail and instance, live instances after it, after b's next report)
SUSPECT_CASES = [
    pytest.param("dst", "b", ["a", "c"], ["a", "b", "c"], id="the target failed"),
    pytest.param("src", "a", ["b", "c"], ["b", "c"], id="the source failed"),
    pytest.param("client", "b", ["a", "b", "c"], ["a", "b", "c"], id="the request ended"),
    pytest.param("dst", "", ["a", "b", "c"], ["a", "b", "c"], id="no instance named"),
    pytest.param("dst", "x", ["a", "b", "c"], ["a", "b", "c"], id="an unknown instance"),
]


@pytest.mark.parametrize(("detail", "named", "live", "after"), SUSPECT_CASES)
def test_the_side_a_move_failed_on_is_out_until_it_reports_again(
    detail: str, named: str, live: list[str], after: list[str]
) -> None:
    """Chaos decode-kill: the scheduler sent move after move to a SIGKILLed
    target (its reports fresh for staleness_s), each aborted and each a
    recompute, until the request's recovery budget ran out."""
    params = PlannerParams(mode=Mode.parse("current"))
    v = view()
    v.apply_report(at(report("a", [4000, 3000, 2500]), 100.0), now=0.0)
    v.apply_report(at(report("b", [10]), 100.0), now=0.0)
    v.apply_report(at(report("c", [300]), 100.0), now=0.0)
    v.book(decision(), now=0.0)
    got = v.apply_event(
        Event(EventKind.ABORTED, 100.2, "proxy:p", migration="m1", instance=named, detail=detail)
    )
    assert got is not None and got[1] == "aborted"
    assert v.suspected == ([named] if live != ["a", "b", "c"] else [])
    assert sorted(i.id for i in v.instances(params)) == live
    assert sorted(e.instance for e in v.load_entries({}, 0.0)) == live  # nor dispatched to
    if "b" not in live:
        assert "b" not in {m.target for m in plan(v.instances(params), params).moves}
    v.apply_report(at(report("b", [10], seq=2), 100.5), now=0.5)  # alive: its next report
    assert sorted(i.id for i in v.instances(params)) == after


# (reports as (instance, loads, draining), planner moves as (source, target),
# instances in the dispatch view). "a" is overloaded, "b" idle, "c" light.
DRAIN_CASES = [
    pytest.param(
        [("a", [4000, 3000, 2500], False), ("b", [10], False)],
        [("a", "b")],
        ["a", "b"],
        id="none draining",
    ),
    pytest.param(
        [("a", [4000, 3000, 2500], False), ("b", [10], True)],
        [("b", "a")],
        ["a"],
        id="a draining instance is never a target; its own request is evacuated",
    ),
    pytest.param(
        [("a", [4000, 3000, 2500], False), ("b", [10], True), ("c", [300], False)],
        [("a", "c")],
        ["a", "c"],
        id="the next target is taken instead",
    ),
    pytest.param(
        [("a", [4000, 3000, 2500], True), ("b", [10], False)],
        [("a", "b")],
        ["b"],
        id="a draining instance is still a source",
    ),
]


@pytest.mark.parametrize(("reports", "moves", "dispatch"), DRAIN_CASES)
def test_a_draining_instance_is_a_source_only_and_out_of_dispatch(
    reports: list[tuple[str, list[int], bool]], moves: list[tuple[str, str]], dispatch: list[str]
) -> None:
    params = PlannerParams(mode=Mode.parse("current"))
    v = view()
    for name, loads, draining in reports:
        v.apply_report(msgspec.structs.replace(report(name, loads), draining=draining), now=0.0)
    instances = v.instances(params)
    assert sorted(i.id for i in instances) == sorted(r[0] for r in reports)  # all still planned
    assert [(m.source, m.target) for m in plan(instances, params).moves] == moves
    assert sorted(e.instance for e in v.load_entries({}, 0.0)) == dispatch


def down_event(instance: str, ts: float) -> Event:
    return Event(EventKind.WORKER_DOWN, ts, instance, instance=instance)


# (reports as (instance, seq, ts, draining), events, decisions as (id, source,
# target, ts), planner instances as (id, in_flight, draining)); now is wall 200.
REBUILD_CASES = [
    pytest.param(
        [("a", 1, 199.0, False), ("b", 1, 199.0, False)],
        [],
        [],
        [("a", False, False), ("b", False, False)],
        id="fresh reports",
    ),
    pytest.param(
        [("a", 1, 199.0, False), ("b", 1, 190.0, False)],
        [],
        [],
        [("a", False, False)],
        id="a stale report",
    ),
    pytest.param(
        [("a", 1, 199.0, False), ("b", 1, 199.0, False)],
        [down_event("b", 199.5)],
        [],
        [("a", False, False)],
        id="worker_down after the last report",
    ),
    pytest.param(
        [("a", 1, 199.0, False), ("b", 1, 199.5, False)],
        [down_event("b", 199.0)],
        [],
        [("a", False, False), ("b", False, False)],
        id="a report after the worker_down (restarted)",
    ),
    pytest.param(
        [("a", 1, 199.0, False), ("b", 1, 199.0, True)],
        [],
        [],
        [("a", False, False), ("b", False, True)],
        id="draining",
    ),
    pytest.param(
        [("a", 1, 199.0, False), ("b", 1, 199.0, False), ("c", 1, 199.0, False)],
        [],
        [("m1", "a", "b", 199.0)],
        [("a", True, False), ("b", True, False), ("c", False, False)],
        id="a decision not yet resolved is booked",
    ),
    pytest.param(
        [("a", 1, 199.0, False), ("b", 1, 199.0, False)],
        [Event(EventKind.RESUMED, 199.5, "proxy", migration="m1")],
        [("m1", "a", "b", 199.0)],
        [("a", False, False), ("b", False, False)],
        id="a resolved decision is not",
    ),
    pytest.param(
        [("a", 1, 199.0, False), ("b", 1, 199.0, False)],
        [],
        [("m1", "a", "b", 189.0)],
        [("a", False, False), ("b", False, False)],
        id="nor an expired one",
    ),
]


@pytest.mark.parametrize(("reports", "events", "decisions", "planned"), REBUILD_CASES)
def test_rebuild_applies_the_schedulers_rules(
    reports: list[tuple[str, int, float, bool]],
    events: list[Event],
    decisions: list[tuple[str, str, str, float]],
    planned: list[tuple[str, bool, bool]],
) -> None:
    v = rebuild(
        [
            msgspec.structs.replace(report(name, [100]), seq=seq, ts=ts, draining=draining)
            for name, seq, ts, draining in reports
        ],
        events,
        [
            msgspec.structs.replace(decision(mid, f"{src}-r0", src, dst), ts=ts)
            for mid, src, dst, ts in decisions
        ],
        staleness_s=3.0,
        decision_timeout_s=10.0,
        now=1000.0,
        now_wall=200.0,
    )
    got = [(i.id, i.in_flight, i.draining) for i in v.instances(P)]
    assert sorted(got) == planned


def test_reported_requests_become_the_planners_requests_field_for_field() -> None:
    loads = [
        RequestLoad("a-r0", 50, 10, 12.5, True, 40),
        RequestLoad("a-r1", 60, 20, None, True),  # in flight: not migratable
        RequestLoad("a-r2", 70, 30, 3.0, False),
    ]
    r = msgspec.structs.replace(report("a", [1]), requests=loads, in_flight=["a-r1"])
    v = view()
    v.apply_report(r, now=0.0)
    expected = tuple(
        Request(
            id=q.id,
            tokens=q.tokens,
            predicted_remaining=q.predicted_remaining,
            true_remaining=q.true_remaining,
            generated=q.generated,
            migratable=q.migratable and q.id != "a-r1",
        )
        for q in loads
    )
    got = v.seen["a"].requests
    assert got == expected and repr(got) == repr(expected)
    assert [type(q) for q in got] == [Request] * 3
    assert to_request(loads[0]) == expected[0] and to_request(loads[0], busy=True) == Request(
        "a-r0", 50, 12.5, 40, 10, migratable=False
    )


def test_to_request_builds_what_the_constructor_builds() -> None:
    # to_request fills the slots of the frozen Request instead of calling __init__.
    built = to_request(RequestLoad("q", 50, 10, 12.5, False, true_remaining=40))
    want = Request(
        "q", 50, predicted_remaining=12.5, true_remaining=40, generated=10, migratable=False
    )
    assert built == want and repr(built) == repr(want) and hash(built) == hash(want)
    assert type(built) is Request
    with pytest.raises(dataclasses.FrozenInstanceError):
        built.tokens = 1  # type: ignore[misc]
