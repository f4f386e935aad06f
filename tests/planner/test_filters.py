"""Table tests: each filter, flag and classification rule of Algorithm 1 on small clusters."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from star.planner import Instance, Mode, Plan, PlannerParams, Request, Verdict, plan
from tests.planner.helpers import inst, req
from tests.planner.reference import reference_plan

# Two grid points ahead, 10 steps apart; migration cost only from the flags
# under test.
P = PlannerParams(horizon=2, delta=10, beta_decay=1.0, handoff_latency_s=0.0)


def verdicts(result: Plan) -> dict[tuple[str, str, str], Verdict]:
    return {(c.request, c.source, c.target): c.verdict for c in result.candidates}


def explained(cluster: list[Instance], params: PlannerParams = P) -> Plan:
    result = plan(cluster, params, explain=True)
    ref = reference_plan(cluster, params, explain=True)
    assert result.moves == ref.moves or [(m.request, m.source, m.target) for m in result.moves] == [
        (m.request, m.source, m.target) for m in ref.moves
    ]
    assert [c.verdict for c in result.candidates] == [c.verdict for c in ref.candidates]
    return result


FEASIBLE = {Verdict.CHOSEN, Verdict.NOT_BEST}


def hot_and_cold(*extra: Request, **flags: Any) -> list[Instance]:
    """s is overloaded by a long request (and a pinned one, so no two moves tie), t is empty."""
    s = inst(
        "s",
        req("big", 7000, 5000),
        req("anchor", 3000, 5000, migratable=False),
        *extra,
        **flags,
    )
    return [s, inst("t")]


@pytest.mark.parametrize(
    ("remaining", "bytes_per_token", "step_time_s", "expect"),
    [
        # C_mig = 4000 * 131072 B / 3.125e9 B/s = 0.168 s = 8.4 steps of 20 ms
        (3.0, 131_072, 0.0, Verdict.TOO_SHORT),  # step time 0 -> default 0.02 s
        (8.0, 131_072, 0.02, Verdict.TOO_SHORT),
        (9.0, 131_072, 0.02, None),
        (3.0, 131_072, 0.1, None),  # slower steps: 1.7 steps to migrate
        (3.0, 0, 0.02, None),  # no KV bytes, no latency: free
    ],
)
def test_too_short_filter(
    remaining: float, bytes_per_token: int, step_time_s: float, expect: Verdict | None
) -> None:
    cluster = hot_and_cold(
        req("short", 4000, remaining), bytes_per_token=bytes_per_token, step_time_s=step_time_s
    )
    result = explained(cluster)
    verdict = verdicts(result)[("short", "s", "t")]
    if expect is None:
        assert verdict in FEASIBLE
    else:
        assert verdict is expect
        assert [m.request for m in result.moves] == ["big"]


def test_handoff_latency_counts_in_the_migration_cost() -> None:
    cluster = hot_and_cold(req("short", 4000, 3.0))
    params = dataclasses.replace(P, handoff_latency_s=0.1)  # 5 steps of 20 ms
    assert verdicts(explained(cluster, params))[("short", "s", "t")] is Verdict.TOO_SHORT


@pytest.mark.parametrize(
    ("capacity", "fits"),
    [
        # target: 100 tokens growing to 120; candidate 4000 growing to 4020
        (4140, True),
        (4139, False),
    ],
)
def test_capacity_is_checked_over_the_whole_horizon(capacity: int, fits: bool) -> None:
    s = inst("s", req("big", 9000, 5000), req("mid", 4000, 5000))
    t = inst("t", req("tiny", 100, 5000), cap=capacity)
    verdict = verdicts(explained([s, t]))[("mid", "s", "t")]
    assert (verdict in FEASIBLE) if fits else (verdict is Verdict.OVER_CAPACITY)


def test_capacity_also_binds_after_the_request_would_end() -> None:
    # The candidate ends after tau_0, but the target alone outgrows its
    # capacity by tau_2: the target "never exceeds C_mem over the horizon".
    s = inst("s", req("big", 9000, 5000, migratable=False), req("blip", 10, 5.0))
    t = inst("t", req("grow", 1000, 5000), cap=1015)
    assert verdicts(explained([s, t]))[("blip", "s", "t")] is Verdict.OVER_CAPACITY


def test_not_migratable_and_busy_requests_are_never_moved() -> None:
    s = inst(
        "s",
        req("pinned", 6000, 5000, migratable=False),
        req("moving", 5000, 5000),
        busy=frozenset({"moving"}),
    )
    result = explained([s, inst("t")])
    v = verdicts(result)
    assert v[("pinned", "s", "t")] is Verdict.NOT_MIGRATABLE
    assert v[("moving", "s", "t")] is Verdict.IN_FLIGHT
    assert result.moves == ()


@pytest.mark.parametrize("which", ["s", "t"])
def test_instances_in_flight_take_no_part(which: str) -> None:
    cluster = [
        inst("s", req("a", 6000, 5000), in_flight=which == "s"),
        inst("t", in_flight=which == "t"),
    ]
    result = explained(cluster)
    assert result.moves == ()
    assert verdicts(result)[("a", "s", "t")] is Verdict.IN_FLIGHT
    assert result.overloaded == ("s",)  # still classified, for the operator


@pytest.mark.parametrize(
    ("draining", "moves"),
    [
        pytest.param((), [("big", "s", "t")], id="none: the idle t takes the move"),
        pytest.param(("t",), [("big", "s", "u")], id="t: never a target, u takes it"),
        pytest.param(("s",), [("big", "s", "t")], id="s: still a source"),
        pytest.param(
            ("t", "u"), [("small", "u", "s")], id="t and u: no target left, u evacuated to s"
        ),
    ],
)
def test_a_draining_instance_is_a_source_never_a_target(
    draining: tuple[str, ...], moves: list[tuple[str, str, str]]
) -> None:
    cluster = [
        inst("s", req("big", 7000, 5000), req("pinned", 3000, 5000, migratable=False)),
        inst("t", draining="t" in draining),
        inst("u", req("small", 500, 5000), draining="u" in draining),
    ]
    result = explained(cluster)
    assert [(m.request, m.source, m.target) for m in result.moves] == moves
    assert not set(result.underloaded) & set(draining)
    assert not {c.target for c in result.candidates} & set(draining)


def test_min_gain_suppresses_small_moves() -> None:
    cluster = hot_and_cold()
    gain = -plan(cluster, P).moves[0].delta_v
    assert plan(cluster, dataclasses.replace(P, min_gain=gain * 0.999)).moves
    result = explained(cluster, dataclasses.replace(P, min_gain=gain * 1.001))
    assert result.moves == ()
    assert verdicts(result)[("big", "s", "t")] is Verdict.NO_GAIN


def test_a_swap_is_no_gain_not_a_rounding_artefact() -> None:
    # Moving the only request of s onto an empty t swaps the traces: Delta-V
    # is exactly 0 and must not be taken for a gain (it would ping-pong).
    for tokens, remaining in [(6000, 5000.0), (1234, 17.3), (99_991, 1e9)]:
        result = explained([inst("s", req("only", tokens, remaining)), inst("t")])
        assert result.moves == ()
        assert verdicts(result)[("only", "s", "t")] is Verdict.NO_GAIN


def test_no_migration_mode_classifies_but_never_moves() -> None:
    cluster = hot_and_cold(req("other", 3000, 5000))
    params = dataclasses.replace(P, mode=Mode.parse("no-migration"))
    result = plan(cluster, params, explain=True)
    assert result.moves == () and result.candidates == ()
    assert result.overloaded == ("s",) and result.underloaded == ("t",)
    assert result.variance_after == result.variance_before > 0


def test_up_to_m_moves_each_instance_in_at_most_one() -> None:
    cluster = [
        inst("s1", req("a", 8000, 5000), req("b", 7000, 5000)),
        inst("s2", req("c", 7500, 5000), req("d", 6000, 5000)),
        inst("t1"),
        inst("t2"),
    ]
    one = explained(cluster, dataclasses.replace(P, max_migrations=1))
    three = explained(cluster, dataclasses.replace(P, max_migrations=3))
    assert len(one.moves) == 1
    assert three.moves[0] == one.moves[0]
    assert len(three.moves) == 2  # four instances make two disjoint pairs
    ends = [x for m in three.moves for x in (m.source, m.target)]
    assert sorted(ends) == ["s1", "s2", "t1", "t2"]
    assert three.variance_after < one.variance_after < one.variance_before
    # M = 0 is no rule of the settings' (scheduler.max_migrations >= 1; mode
    # no-migration is how not to migrate), so the planner refuses it too.
    with pytest.raises(ValueError, match="max_migrations=0"):
        plan(cluster, dataclasses.replace(P, max_migrations=0))


def two_pairs(bytes_per_token: int = 0) -> list[Instance]:
    """Two overloaded sources, two empty targets; on s2, c is the better move, d the smaller."""
    kw = {"bytes_per_token": bytes_per_token}
    return [
        inst("s1", req("a", 8000, 5000), req("b", 7000, 5000), **kw),
        inst(
            "s2",
            req("c", 7500, 5000),
            req("d", 6000, 5000),
            req("pin", 1000, 5000, migratable=False),
            **kw,
        ),
        inst("t1"),
        inst("t2"),
    ]


def test_auto_moves_once_per_overloaded_instance() -> None:
    result = explained(two_pairs(), dataclasses.replace(P, max_migrations="auto"))
    assert result.overloaded == ("s1", "s2")
    assert [(m.request, m.source, m.target) for m in result.moves] == [
        ("a", "s1", "t1"),
        ("c", "s2", "t2"),
    ]
    # auto is |O| = 2 here: the same as any M >= 2
    assert result.moves == plan(two_pairs(), dataclasses.replace(P, max_migrations=5)).moves


@pytest.mark.parametrize(
    ("budget_mb", "expect"),
    [
        (0.0, ["a", "c"]),  # no budget
        (1.0, ["a"]),  # smaller than any request: the first move only
        (14.5, ["a", "d"]),  # 8 MB moved, c (7.5 MB) no longer fits, d (6 MB) does
        (16.0, ["a", "c"]),
    ],
)
def test_transfer_budget_bounds_a_ticks_moves_after_the_first(
    budget_mb: float, expect: list[str]
) -> None:
    params = dataclasses.replace(
        P, max_migrations="auto", transfer_budget_s=budget_mb * 1e6 / P.bandwidth_bytes_per_s
    )
    result = explained(two_pairs(bytes_per_token=1000), params)
    assert [m.request for m in result.moves] == expect
    assert result.variance_after < result.variance_before


def test_underloaded_compares_the_current_load_with_the_mean_workload() -> None:
    # b is small now but grows (long requests): overloaded by its future
    # workload, yet underloaded by its current load. a is large now but
    # finishing: neither. c is empty.
    params = PlannerParams(horizon=4, delta=1000, beta_decay=1.0, theta=0.1)
    a = inst("a", req("done", 3000, 1.0))
    b = inst("b", req("b1", 1000, None), req("b2", 1000, None))
    c = inst("c")
    result = explained([a, b, c], params)
    assert result.workloads == {"a": 600.0, "b": 6000.0, "c": 0.0}
    assert result.overloaded == ("b",)
    assert result.underloaded == ("b", "c")  # the pair (b, b) is excluded
    assert [(m.source, m.target) for m in result.moves] == [("b", "c")]


def test_prediction_changes_the_choice() -> None:
    # `current` sees "soon" as the bigger load and moves it; `predicted` knows
    # it finishes within the first grid step and moves the long request.
    s = inst(
        "s",
        req("soon", 5000, 2.0),
        req("long", 2000, 5000),
        req("pinned", 3000, 5000, migratable=False),
    )
    cluster = [s, inst("t")]
    base = PlannerParams(horizon=4, delta=500, handoff_latency_s=0.0)
    cur = explained(cluster, dataclasses.replace(base, mode=Mode.parse("current")))
    pred = explained(cluster, base)
    assert [m.request for m in cur.moves] == ["soon"]
    assert [m.request for m in pred.moves] == ["long"]


def test_worker_trace_is_used_in_predicted_mode_when_it_has_h_plus_1_points() -> None:
    # The requests say "balanced"; the worker's own simulation says x is hot.
    hot = (50_000.0, 50_000.0, 50_000.0)
    x = inst("x", req("x1", 1000, 5000), req("x2", 900, 5000), trace=hot)
    y = inst("y", req("y1", 1000, 5000), req("y2", 900, 5000))
    assert explained([x, y]).overloaded == ("x",)
    short = dataclasses.replace(x, trace=hot[:2])
    assert explained([short, y]).overloaded == ()
    assert explained([x, y], dataclasses.replace(P, mode=Mode.parse("oracle"))).overloaded == ()


def test_empty_cluster_and_lonely_instance() -> None:
    assert plan([], P) == Plan((), {}, 0.0, (), (), 0.0, 0.0)
    only = plan([inst("s", req("a", 5000, 100))], P, explain=True)
    assert only.moves == () and only.candidates == ()
