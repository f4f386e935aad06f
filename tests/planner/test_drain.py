"""Table tests: evacuating draining instances (``star.planner.drain``) on small clusters.

Every case is also planned by the brute-force reference, which must agree
(``tests/planner/test_against_reference.py`` does the same on random clusters).
"""

from __future__ import annotations

import dataclasses

import pytest

from star.planner import Instance, Mode, PlannerParams, plan
from star.planner.types import BALANCE, DRAIN
from tests.planner.helpers import inst, req
from tests.planner.reference import reference_plan

P = PlannerParams(horizon=2, delta=10, beta_decay=1.0, handoff_latency_s=0.0)


def moves(cluster: list[Instance], params: PlannerParams = P) -> list[tuple[str, str, str, str]]:
    result = plan(cluster, params)
    ref = reference_plan(cluster, params)
    got = [(m.request, m.source, m.target, m.reason) for m in result.moves]
    assert got == [(m.request, m.source, m.target, m.reason) for m in ref.moves]
    for a, b in zip(result.moves, ref.moves, strict=True):
        assert a.delta_v == pytest.approx(b.delta_v, rel=1e-9, abs=1e-6)
    return got


def test_a_draining_instance_that_is_not_overloaded_moves_its_longest_request_out() -> None:
    # d is light (Algorithm 1 would leave it alone) and draining: its longest
    # predicted request goes to the less loaded of the other two.
    cluster = [
        inst("d", req("short", 100, 40), req("long", 100, 900), draining=True),
        inst("busy", req("x", 3000, 900)),
        inst("calm", req("y", 500, 900)),
    ]
    assert moves(cluster) == [("long", "d", "calm", DRAIN)]
    # The same cluster without the drain: nothing moves.
    assert moves([dataclasses.replace(cluster[0], draining=False), *cluster[1:]]) == []


# An instance heavy with a request that may not move keeps the draining one
# below the mean, so Algorithm 1 moves nothing and only the drain acts.
HEAVY = inst("heavy", req("pinned", 40_000, 5000, migratable=False))


def test_without_predictions_the_least_kv_goes_first() -> None:
    cluster = [
        inst("d", req("big", 4000), req("small", 200), req("mid", 900), draining=True),
        HEAVY,
        inst("t"),
    ]
    assert moves(cluster, dataclasses.replace(P, mode=Mode.parse("current"))) == [
        ("small", "d", "t", DRAIN)
    ]


def test_requests_that_may_not_or_need_not_move_stay() -> None:
    # "soon" ends before its KV could arrive (Phase 2's rule); "pinned" may
    # not move; "moving" is migrating already: "left" is the one to go.
    slow = dataclasses.replace(P, handoff_latency_s=0.2)  # 10 steps of 20 ms
    cluster = [
        inst(
            "d",
            req("soon", 100, 5),
            req("pinned", 100, 5000, migratable=False),
            req("moving", 100, 4000),
            req("left", 100, 60),
            busy=frozenset({"moving"}),
            draining=True,
        ),
        HEAVY,
        inst("t"),
    ]
    assert moves(cluster, slow) == [("left", "d", "t", DRAIN)]


def test_a_target_without_room_is_skipped_and_none_means_no_move() -> None:
    cluster = [
        inst("d", req("a", 1000, 500), draining=True),
        # The least loaded, but 300 + 1000 tokens (+ 20 steps each) exceed 1200.
        inst("full", req("w", 300, 900), cap=1200),
        inst("roomy", req("z", 2000, 100), cap=10_000),
    ]
    assert moves(cluster) == [("a", "d", "roomy", DRAIN)]
    assert moves(cluster[:2]) == []


@pytest.mark.parametrize(
    ("flags", "expect"),
    [
        pytest.param({}, [("a", "d", "t", DRAIN)], id="plain"),
        pytest.param({"d": {"in_flight": True}}, [], id="source in flight"),
        pytest.param({"t": {"in_flight": True}}, [], id="only target in flight"),
        pytest.param({"t": {"draining": True}}, [], id="only other instance draining too"),
    ],
)
def test_instances_in_a_migration_or_draining_are_no_targets(
    flags: dict[str, dict[str, bool]], expect: list[tuple[str, str, str, str]]
) -> None:
    cluster = [
        inst("d", req("a", 100, 500), draining=True, **flags.get("d", {})),
        inst("t", **flags.get("t", {})),
    ]
    assert moves(cluster) == expect


def test_one_move_per_instance_per_tick_after_algorithm_1() -> None:
    # Algorithm 1 moves "big" from the overloaded s to the idle t; both draining
    # instances then need a target of their own: d1 gets u, d2 none is left.
    cluster = [
        inst("s", req("big", 7000, 5000), req("anchor", 3000, 5000, migratable=False)),
        inst("t"),
        inst("d1", req("a", 100, 500), draining=True),
        inst("d2", req("b", 100, 500), draining=True),
        inst("u", req("c", 200, 500)),
    ]
    got = moves(cluster)
    assert got == [("big", "s", "t", BALANCE), ("a", "d1", "u", DRAIN)]


def test_no_migration_mode_moves_nothing_even_to_drain() -> None:
    cluster = [inst("d", req("a", 100, 500), draining=True), inst("t")]
    assert moves(cluster, dataclasses.replace(P, mode=Mode.parse("no-migration"))) == []


def test_the_variance_after_counts_the_evacuation() -> None:
    cluster = [inst("d", req("a", 100, 500), draining=True), inst("t", req("b", 1000, 500))]
    result = plan(cluster, P)
    (move,) = result.moves
    assert move.reason == DRAIN and move.delta_v > 0  # onto the loaded one: V rises
    assert result.variance_after == pytest.approx(result.variance_before + move.delta_v)
