"""Plain data the planner takes and returns (paper §5.2, docs/design.md §3).

These types are the contract between the live scheduler, ``star plan`` and
the simulator: all three build :class:`Instance` values and call
:func:`star.planner.plan` with the same :class:`PlannerParams`.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

from star.planner.modes import Mode, ModeKind
from star.rules import Rule, positive
from star.settings import RULES, Settings

__all__ = [
    "AUTO",
    "BALANCE",
    "DRAIN",
    "PARAM_RULES",
    "Candidate",
    "Instance",
    "Mode",
    "ModeKind",
    "Move",
    "Plan",
    "PlannerParams",
    "Request",
    "Verdict",
    "validate_params",
]


@dataclass(frozen=True, slots=True)
class Request:
    """One running request on a decode instance.

    ``tokens`` is N(r), the tokens in its KV (prompt + generated);
    ``predicted_remaining`` is R-hat(r) from the length predictor (None when no
    prediction was made yet); ``true_remaining`` is only known to the
    simulator and tests (``oracle`` mode).
    """

    id: str
    tokens: int
    predicted_remaining: float | None = None
    true_remaining: int | None = None
    generated: int = 0
    migratable: bool = True


@dataclass(frozen=True, slots=True)
class Instance:
    """A decode instance as the scheduler sees it at one tick.

    ``trace`` is the worker's own pre-simulated load L(tau_0..tau_H) (paper
    Algorithm 1, "pre-simulated state reports"); the planner uses it when its
    length matches the horizon and falls back to computing it from
    ``requests`` otherwise. ``in_flight`` marks an instance already taking
    part in a migration; ``busy`` lists requests that are being migrated.
    A ``draining`` instance (its worker is stopping) takes no new requests:
    it may be a migration source, never a target.
    """

    id: str
    requests: tuple[Request, ...]
    capacity_tokens: int
    bytes_per_token: int = 0
    step_time_s: float = 0.0
    in_flight: bool = False
    busy: frozenset[str] = field(default_factory=frozenset)
    trace: tuple[float, ...] | None = None
    draining: bool = False


@dataclass(frozen=True, slots=True)
class PlannerParams:
    """Knobs of Algorithm 1; defaults documented in docs/configuration.md.

    ``horizon`` is H (grid points tau_j = j * ``delta`` decode steps, j = 0..H),
    ``beta_decay`` makes beta_j proportional to ``beta_decay ** j`` before
    normalisation, ``theta`` is the classification threshold, ``min_gain`` is
    epsilon (do nothing unless Delta-V < -epsilon), ``max_migrations`` is M:
    an integer, or :data:`AUTO` for M = |O| this tick (every overloaded
    instance may shed one request; 1 is the paper's rule). Every move of a
    tick but the first must fit, with those before it, in ``transfer_budget_s``
    x ``bandwidth_bytes_per_s`` bytes of KV (0: no budget).
    C_mig(r) = KV bytes of r / ``bandwidth_bytes_per_s`` + ``handoff_latency_s``.
    """

    # The [scheduler] settings' defaults, declared once there (star.settings).
    mode: Mode = Mode.parse(RULES["scheduler.mode"].default)  # noqa: RUF009 (Mode is frozen)
    horizon: int = RULES["scheduler.horizon"].default
    delta: int = RULES["scheduler.delta"].default
    beta_decay: float = RULES["scheduler.beta_decay"].default
    theta: float = RULES["scheduler.theta"].default
    min_gain: float = RULES["scheduler.min_gain"].default
    max_migrations: int | Literal["auto"] = RULES["scheduler.max_migrations"].default
    bandwidth_bytes_per_s: float = RULES["scheduler.bandwidth_gbps"].default * 1e9 / 8
    handoff_latency_s: float = RULES["scheduler.handoff_latency_s"].default
    default_step_time_s: float = 0.02
    transfer_budget_s: float = RULES["scheduler.transfer_budget_s"].default
    # The length scale of ``bins:K`` edges: the paper's edges (up to 32,768
    # tokens, its models' context) times bins_scale_tokens / 32768. The
    # simulator models the paper's lengths and keeps 32768; the live scheduler
    # passes the served model's (scheduler.bins_scale_tokens).
    bins_scale_tokens: int = 32768

    @classmethod
    def from_settings(cls, settings: Settings) -> PlannerParams:
        """The planner's knobs from ``[scheduler]`` settings (the live scheduler, ``star plan``)."""
        s = settings.scheduler
        return cls(
            mode=Mode.parse(s.mode),
            horizon=s.horizon,
            delta=s.delta,
            beta_decay=s.beta_decay,
            theta=s.theta,
            min_gain=s.min_gain,
            max_migrations=s.max_migrations,
            bandwidth_bytes_per_s=s.bandwidth_gbps * 1e9 / 8,
            handoff_latency_s=s.handoff_latency_s,
            transfer_budget_s=s.transfer_budget_s,
            # bins:K edges at the served model's length scale (its context length
            # unless set), not the paper's 32K-token answers.
            bins_scale_tokens=s.bins_scale_tokens or settings.worker.max_model_len,
        )


AUTO: Literal["auto"] = "auto"
"""``PlannerParams.max_migrations``: as many moves per tick as there are overloaded instances."""


# Each parameter follows the rule of the [scheduler] setting it comes from (one
# rule, star.settings.RULES); the two the settings do not hold use the same bound.
# bins_scale_tokens: the setting's 0 means worker.max_model_len, which
# from_settings resolves, so the planner's own value is >= 1.
PARAM_RULES: Mapping[str, Rule] = {
    "horizon": RULES["scheduler.horizon"],
    "delta": RULES["scheduler.delta"],
    "beta_decay": RULES["scheduler.beta_decay"],
    "theta": RULES["scheduler.theta"],
    "min_gain": RULES["scheduler.min_gain"],
    "max_migrations": RULES["scheduler.max_migrations"],
    "bandwidth_bytes_per_s": RULES["scheduler.bandwidth_gbps"],  # > 0 in any unit
    "handoff_latency_s": RULES["scheduler.handoff_latency_s"],
    "default_step_time_s": Rule("default_step_time_s", float, positive),
    "transfer_budget_s": RULES["scheduler.transfer_budget_s"],
    "bins_scale_tokens": Rule("bins_scale_tokens", int, positive),
}
"""The :class:`~star.settings.Rule` of every :class:`PlannerParams` field but ``mode``."""


def validate_params(params: PlannerParams) -> None:
    """Raise ValueError, quoting the bad value, for parameters Algorithm 1 cannot use."""
    # Every tick calls this with the same few parameter sets: remember the good
    # ones, keyed with each value's type (True == 1 and 2.0 == 2, yet refused).
    values = tuple((type(v), v) for v in (getattr(params, f) for f in _FIELDS))
    try:
        if values in _GOOD:
            return
    except TypeError:  # an unhashable value: no rule takes one
        pass
    if not isinstance(params.mode, Mode):
        raise ValueError(f"planner parameter mode={params.mode!r}: expected a Mode (Mode.parse)")
    for name, rule in PARAM_RULES.items():
        value = getattr(params, name)
        problem = rule.problem(value)
        if problem:
            raise ValueError(f"planner parameter {name}={value!r}: {problem}")
    if len(_GOOD) < 256:
        _GOOD.add(values)


_FIELDS = tuple(f.name for f in dataclasses.fields(PlannerParams))
_GOOD: set[tuple[tuple[type, object], ...]] = set()


class Verdict(enum.StrEnum):
    """Why a candidate (r, s, t) was or was not chosen (for ``star plan``)."""

    CHOSEN = "chosen"
    NOT_BEST = "not-best"
    NO_GAIN = "no-gain"  # Delta-V >= -epsilon
    TOO_SHORT = "too-short"  # R-hat <= C_mig / T_exec
    OVER_CAPACITY = "over-capacity"  # target would exceed C_mem within the horizon
    NOT_MIGRATABLE = "not-migratable"  # sampling state cannot be carried
    IN_FLIGHT = "in-flight"  # request already migrating


@dataclass(frozen=True, slots=True)
class Candidate:
    """One (r, s, t) the planner looked at, with its Delta-V where computed."""

    request: str
    source: str
    target: str
    delta_v: float | None
    verdict: Verdict


@dataclass(frozen=True, slots=True)
class Move:
    """A migration the planner decided: move ``request`` from ``source`` to ``target``.

    ``reason`` is :data:`BALANCE` (Algorithm 1: it lowers the load variance)
    or :data:`DRAIN` (the source is draining: :mod:`star.planner.drain`).
    """

    request: str
    source: str
    target: str
    delta_v: float
    tokens: int
    remaining: float
    reason: str = "balance"


BALANCE = "balance"
DRAIN = "drain"


@dataclass(frozen=True, slots=True)
class Plan:
    """The outcome of one tick."""

    moves: tuple[Move, ...]
    workloads: dict[str, float]
    mean_workload: float
    overloaded: tuple[str, ...]
    underloaded: tuple[str, ...]
    variance_before: float
    variance_after: float
    candidates: tuple[Candidate, ...] = ()
