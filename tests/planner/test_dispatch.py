"""P->D dispatch policies (paper §2, §6.1)."""

from __future__ import annotations

import numpy as np
import pytest

from star.planner import Mode, PlannerParams
from star.planner.dispatch import POLICIES, booking, choose_decode, choose_on_view
from star.settings import RULES
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


# The settings' rule refuses it, in its words (star.settings.RULES["proxy.dispatch"]).
REFUSED = "dispatch policy 'least-loaded': must be one of round-robin, current-load, predicted"


def test_bad_policy_is_quoted() -> None:
    with pytest.raises(ValueError, match=REFUSED):
        choose_decode("least-loaded", [NOW], 1, None, P, 0)


@pytest.mark.parametrize("policy", POLICIES)
def test_no_instances_is_an_error(policy: str) -> None:
    with pytest.raises(ValueError, match="no decode instances"):
        choose_decode(policy, [], 1, None, P, 0)


# -- on a load view of one number per instance (the proxies', the simulator's) --------


def test_on_a_view_round_robin_follows_the_callers_counter() -> None:
    load, cap = np.array([5.0, 0.0, 9.0]), np.full(3, 10.0)
    picks = [choose_on_view("round-robin", load, cap, 100, k) for k in range(4)]
    assert picks == [0, 1, 2, 0]


def test_on_a_view_load_aware_policies_pass_over_instances_without_room() -> None:
    load = np.array([100.0, 900.0, 2000.0])
    cap = np.array([1000.0, 10_000.0, 10_000.0])
    work = np.array([5000.0, 3000.0, 1000.0])
    assert choose_on_view("current-load", load, cap, 10, 0) == 0
    assert choose_on_view("current-load", load, cap, 901, 0) == 1  # 100 + 901 > 1,000
    assert choose_on_view("predicted", load, cap, 10, 0, work) == 2
    assert choose_on_view("predicted", load, cap, 8001, 0, work) == 1  # 2,000 + 8,001 > cap
    assert choose_on_view("predicted", load, cap, 10, 0) == 0  # no work: the load
    # nobody fits: the least anyway
    assert choose_on_view("current-load", load, cap, 10**9, 0) == 0
    assert choose_on_view("predicted", load, cap, 10**9, 0, work) == 2


def test_on_a_view_ties_go_to_the_first_instance() -> None:
    load, cap = np.array([7.0, 3.0, 3.0]), np.full(3, 100.0)
    assert choose_on_view("current-load", load, cap, 1, 0) == 1
    assert choose_on_view("predicted", load, cap, 1, 0, load) == 1


def test_on_a_view_a_bad_policy_is_quoted_and_no_instances_an_error() -> None:
    one = np.ones(1)
    with pytest.raises(ValueError, match=REFUSED):
        choose_on_view("least-loaded", one, one, 1, 0)
    with pytest.raises(ValueError, match="no decode instances"):
        choose_on_view("current-load", np.zeros(0), np.zeros(0), 1, 0)


def test_booking_by_charge_and_a_bad_charge_in_the_settings_words() -> None:
    assert booking(100, "expected", 40.5) == 140.5
    assert booking(100, "prompt", 40.5) == 100
    said = RULES["proxy.dispatch_charge"].problem("all")
    assert said == "must be one of expected, prompt"
    with pytest.raises(ValueError, match=f"^dispatch charge 'all': {said}$"):
        booking(100, "all", 0.0)
