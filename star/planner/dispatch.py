"""P->D dispatch: which decode instance a request goes to after prefill.

Paper §2 and §6.1 compare three ways to place a freshly prefilled request;
rescheduling (Algorithm 1) then corrects what dispatch got wrong:

- ``round-robin`` (vLLM's PD proxy): "assigns requests to decode instances in a
  round-robin manner, ensuring an even distribution of requests";
- ``current-load`` (FlowKV): "allocates requests based on the current load of
  each decode instance, i.e., size of KV cache" -- the least token load L_i(0),
  "the common foundation of every compared strategy" (docs/design.md §3);
- ``predicted``: the least weighted future workload w_i = sum_j beta_j L_i(tau_j)
  after adding the new request with its predicted length.

The two load-aware policies pass over instances that could not hold the
request (``current-load``: L_i(0) + new_tokens > capacity; ``predicted``:
max_j L_i(tau_j) + c_new(tau_j) > capacity over the horizon) unless none can;
adding the request raises every instance's w_i by the same amount, so this
capacity look-ahead is what "after adding" changes in the choice. Ties go to
the first instance in the given order.

:func:`choose_on_view` is the rule on a load view of one number per instance
(what the proxies read, ``<prefix>:load``, and the simulator's ``current-load``
view): the simulator's ``round-robin`` and ``current-load`` dispatch and every
proxy dispatch go through it, so the simulator and the fleet choose alike.
:func:`choose_decode` is the rule on the planner's full input (the simulator's
``predicted`` dispatch).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from star.planner.trace import (
    BoolArray,
    FloatArray,
    contribution,
    grid,
    instance_traces,
    weights,
)
from star.planner.types import Instance, Mode, ModeKind, PlannerParams
from star.settings import DISPATCH_POLICIES, RULES

POLICIES: tuple[str, ...] = DISPATCH_POLICIES  # the settings validate against the same tuple


def _refused(what: str, key: str, value: object) -> ValueError:
    """A value the callers should have checked by setting ``key``'s rule (the
    settings, the simulator's config, a proxy on a published policy), refused in
    that rule's words; "not handled here" if the rule takes it (a new choice
    without its branch below)."""
    return ValueError(f"{what} {value!r}: {RULES[key].problem(value) or 'not handled here'}")


def _future_params(params: PlannerParams) -> PlannerParams:
    """The planner's view of the future, even when rescheduling itself is off.

    ``predicted`` dispatch needs R-hat: in ``current``/``no-migration`` modes it
    uses the predictor's output (``predicted`` mode) over ``params.horizon``.
    """
    if params.mode.kind in (ModeKind.CURRENT, ModeKind.NO_MIGRATION):
        return PlannerParams(
            mode=Mode(ModeKind.PREDICTED),
            horizon=params.horizon,
            delta=params.delta,
            beta_decay=params.beta_decay,
        )
    return params


def choose_decode(
    policy: str,
    instances: Sequence[Instance],
    new_tokens: int,
    predicted_len: float | None,
    params: PlannerParams,
    rr_counter: int,
) -> str:
    """Pick the decode instance id for a request with ``new_tokens`` in its KV.

    ``predicted_len`` is its predicted remaining length (``None``: unknown,
    treated as running past the horizon, as in :func:`remaining_for`);
    ``rr_counter`` is the caller's round-robin position (it owns the counter
    so that this function stays pure).
    """
    if not instances:
        raise ValueError("no decode instances to dispatch to")
    cap = np.array([inst.capacity_tokens for inst in instances], dtype=np.float64)
    if policy != "predicted":  # round-robin and current-load read one number per instance
        load = np.array(
            [sum(r.tokens for r in inst.requests) for inst in instances], dtype=np.float64
        )
        return instances[choose_on_view(policy, load, cap, new_tokens, rr_counter)].id

    future = _future_params(params)
    traces = instance_traces(instances, future)
    beta = weights(future)
    remaining = math.inf if predicted_len is None else max(float(predicted_len), 1.0)
    added = contribution(float(new_tokens), remaining, grid(future))
    after = traces + added
    fits = after.max(axis=1) <= cap
    return instances[_least(after @ beta, fits)].id


def choose_on_view(
    policy: str,
    load: FloatArray,
    capacity: FloatArray,
    new_tokens: float,
    rr_counter: int,
    work: FloatArray | None = None,
) -> int:
    """P->D dispatch on a load view: the index of the instance chosen for a
    request with ``new_tokens`` in its KV (the prompt and its first token).

    ``load`` is each instance's token load L_i(0) as the view has it plus what
    the caller dispatched to it since (:func:`booking`), ``capacity`` its KV
    capacity; ``rr_counter`` the caller's round-robin position (its decode
    dispatches so far). ``round-robin``: ``rr_counter`` modulo the count;
    ``current-load``: :func:`least_loaded`; ``predicted``: the least ``work``
    (the scheduler's w_i = sum_j beta_j L_i(tau_j), ``load`` if not given)
    among the instances that can hold ``new_tokens`` more now, or among all if
    none can -- a view of one number per instance carries no horizon, so
    :func:`choose_decode`'s look-ahead over it is not checked here.

    ``policy`` is one of ``DISPATCH_POLICIES``; :mod:`star.settings` validates
    it (configured, or published by a scheduler: ``dispatch_policy``).
    """
    n = len(load)
    if n == 0:
        raise ValueError("no decode instances to dispatch to")
    if policy == "round-robin":
        return rr_counter % n
    if policy == "current-load":
        return least_loaded(load, capacity, new_tokens)
    if policy == "predicted":
        score = load if work is None else work
        return _least(score, load + new_tokens <= capacity)
    raise _refused("dispatch policy", "proxy.dispatch", policy)


def least_loaded(load: FloatArray, capacity: FloatArray, new_tokens: float) -> int:
    """``current-load`` on arrays: the index of the least token load L_i(0) among
    the instances that can take ``new_tokens`` more, or among all if none can.

    :func:`choose_decode` calls it for ``current-load``; the simulator calls
    it directly on its load view (one number per instance).
    """
    i = int(load.argmin())
    if load[i] + new_tokens <= capacity[i]:
        return i  # the first least loaded instance fits: it is the answer
    return _least(load, load + new_tokens <= capacity)


def _least(score: FloatArray, fits: BoolArray) -> int:
    """Index of the least score among instances that fit, or among all if none fit."""
    if fits.any():
        score = np.where(fits, score, np.inf)
    return int(np.argmin(score))


class OutputMean:
    """The mean output length of the requests finished so far: what a
    ``current-load`` dispatch expects a new request to grow by (:func:`booking`). A dispatcher relays every token, so it knows this
    without a predictor.

    Why: the load view is refreshed once a tick, so between two views the
    least loaded instance takes new requests until their bookings catch up.
    Booked at the prompt alone, a request weighs a fraction of what it will
    hold, and the tick's arrivals, which grow with the cluster, pile onto one
    instance (in simulation: up to 71 in one 1 s tick at 1,024 instances, 22
    on average; with the expected footprint, at most 10 and 2.5: the power of
    old information, Mitzenmacher 2000, docs/simulator.md "Dispatch booking").
    """

    __slots__ = ("count", "total")

    def __init__(self) -> None:
        self.count = 0
        self.total = 0

    def add(self, output_tokens: int) -> None:
        self.count += 1
        self.total += output_tokens

    @property
    def mean(self) -> float:
        return self.total / self.count if self.count else 0.0


def booking(new_tokens: float, charge: str, mean_output: float) -> float:
    """Tokens a ``current-load`` dispatch of a request holding ``new_tokens``
    books on its instance until the next load view replaces the booking with
    what the instance holds (``charge``, one of ``DISPATCH_CHARGES``):
    ``expected``, its expected footprint, plus ``mean_output`` (the mean
    output length of the requests finished so far, :class:`OutputMean`);
    ``prompt``, what it holds at dispatch."""
    if charge == "expected":
        return new_tokens + mean_output
    if charge == "prompt":
        return new_tokens
    raise _refused("dispatch charge", "proxy.dispatch_charge", charge)
