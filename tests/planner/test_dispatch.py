"""P->D dispatch policies (paper §2, §6.1)."""

from __future__ import annotations

import pytest

from star.planner import Mode, PlannerParams
from star.planner.dispatch import POLICIES, choose_decode
from tests.planner.helpers import inst, req

P = PlannerParams(horizon=4, delta=500, beta_decay=1.0)

# "now" is the lighter instance now but its requests run long; "later" is
# heavier now but everything on it ends within the first grid step.
NOW = inst("now", req("n1", 3000, 20_000), req("n2", 3000, 20_000))
LATER = inst("later", req("l1", 5000, 10.0), req("l2", 4000, 10.0))
EMPTYISH = inst("emptyish", req("e1", 8000, 20_000))


@pytest.mark.parametrize("counter", [0, 1, 2, 3, 7])
def test_round_robin_follows_the_callers_counter(counter: int) -> None:
    cluster = [NOW, LATER, EMPTYISH]
    assert choose_decode("round-robin", cluster, 100, None, P, counter) == cluster[counter % 3].id


def test_current_load_picks_the_least_tokens_now() -> None:
    assert choose_decode("current-load", [LATER, NOW, EMPTYISH], 100, 50.0, P, 0) == "now"


def test_predicted_picks_the_least_future_workload() -> None:
    assert choose_decode("predicted", [NOW, LATER, EMPTYISH], 100, 50.0, P, 0) == "later"


def test_predicted_works_when_the_planner_mode_has_no_future() -> None:
    for mode in ("current", "no-migration"):
        params = PlannerParams(mode=Mode.parse(mode), horizon=4, delta=500, beta_decay=1.0)
        assert choose_decode("predicted", [NOW, LATER], 100, None, params, 0) == "later"


def test_ties_go_to_the_first_instance() -> None:
    a, b = inst("a", req("x", 10, 5.0)), inst("b", req("y", 10, 5.0))
    for policy in ("current-load", "predicted"):
        assert choose_decode(policy, [a, b], 1, 1.0, P, 0) == "a"
        assert choose_decode(policy, [b, a], 1, 1.0, P, 0) == "b"


def test_load_aware_policies_pass_over_instances_that_cannot_hold_the_request() -> None:
    small = inst("small", cap=1000)
    roomy = inst("roomy", req("r", 5000, 20_000))
    assert choose_decode("current-load", [small, roomy], 2000, None, P, 0) == "roomy"
    # fits now (900 tokens) but not once it has grown for the horizon
    assert choose_decode("current-load", [small, roomy], 900, None, P, 0) == "small"
    assert choose_decode("predicted", [small, roomy], 900, None, P, 0) == "roomy"
    # a short prediction frees it in time
    assert choose_decode("predicted", [small, roomy], 900, 10.0, P, 0) == "small"
    # nobody fits: least loaded anyway
    assert choose_decode("current-load", [roomy, small], 10**10, None, P, 0) == "small"


def test_bad_policy_is_quoted() -> None:
    with pytest.raises(ValueError, match="unknown dispatch policy 'least-loaded'"):
        choose_decode("least-loaded", [NOW], 1, None, P, 0)


@pytest.mark.parametrize("policy", POLICIES)
def test_no_instances_is_an_error(policy: str) -> None:
    with pytest.raises(ValueError, match="no decode instances"):
        choose_decode(policy, [], 1, None, P, 0)
