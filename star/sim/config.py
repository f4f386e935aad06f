"""The simulator's configuration: one frozen dataclass with documented defaults.

:class:`SimConfig` holds the cluster, load, timing, KV, SLO, prediction
and planner settings of one run, built once by ``star simulate`` (flags,
then ``--set``) and passed down; with the seed it fixes the run.
Defaults follow paper §6.3 (0.3 RPS per 8-instance cluster, here 0.4 per 8
decode instances; 25 Gbps; 2,000 s of ShareGPT), §5.2-5.3 (linear
iteration time, 18.23 ms at 50 % KV) and §6.2 (TTFT 1 s, TPOT 25 ms);
where each number comes from: docs/simulator.md, "What is simulated".
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any

from star.planner.types import Mode, ModeKind, PlannerParams, validate_params
from star.rules import Check, Rule, non_negative, one_of, positive
from star.settings import RULES
from star.sim.predictor import PREDICT_LATENCY_S
from star.sim.workload import MAX_OUTPUT_TOKENS, SYNTHETIC

PREDICTORS = ("noisy", "oracle")


def _own(name: str, tp: Any, check: Check | None = None) -> Rule:
    """The rule of a field no setting holds, with the settings' bounds (star.settings)."""
    return Rule(f"simulator setting {name}", tp, check)


# Every field's rule: the setting's where one mirrors it (one rule,
# star.settings.RULES), else the settings' own bounds. ``planner``: validate_params.
RULES_BY_FIELD: dict[str, Rule] = {
    "decode_instances": _own("decode_instances", int, positive),
    "prefill_instances": _own("prefill_instances", int, non_negative),  # 0: decode / 3
    "duration_s": RULES["simulator.duration_s"],
    "rate_rps": _own("rate_rps", float, non_negative),  # 0: rate_per_8
    "rate_per_8": RULES["simulator.rate_per_8"],
    "workload": _own("workload", str, one_of(*SYNTHETIC)),
    "seed": _own("seed", int),
    "mode": RULES["scheduler.mode"],
    "dispatch": RULES["scheduler.dispatch"],
    "dispatch_charge": RULES["proxy.dispatch_charge"],
    "predictor": _own("predictor", str, one_of(*PREDICTORS)),
    "predict_every": RULES["predictor.every_k"],
    "predict_latency_s": _own("predict_latency_s", float, non_negative),
    "step_base_s": _own("step_base_s", float, positive),
    "step_per_token_s": _own("step_per_token_s", float, non_negative),
    "kv_capacity_tokens": _own("kv_capacity_tokens", int, positive),
    "bytes_per_token": _own("bytes_per_token", int, positive),
    "bandwidth_gbps": RULES["simulator.bandwidth_gbps"],
    "handoff_latency_s": RULES["scheduler.handoff_latency_s"],
    "migration_latency_s": _own("migration_latency_s", float, non_negative),  # None: handoff's
    "kv_block_tokens": _own("kv_block_tokens", int, positive),
    "plan_kv_blocks": _own("plan_kv_blocks", bool),
    "prefill_base_s": _own("prefill_base_s", float, non_negative),
    "prefill_per_token_s": _own("prefill_per_token_s", float, non_negative),
    "tick_s": RULES["simulator.tick_s"],
    "warmup_s": _own("warmup_s", float, non_negative),
    "ttft_slo_s": _own("ttft_slo_s", float, non_negative),
    "tpot_slo_s": _own("tpot_slo_s", float, non_negative),
    "max_output_tokens": _own("max_output_tokens", int, positive),
    "drain": _own("drain", bool),
    "gate": _own("gate", bool),
}


class ConfigError(ValueError):
    """A simulator setting is out of range."""


@dataclass(frozen=True)
class SimConfig:
    """Everything one simulated run depends on (with the seed, fully deterministic)."""

    decode_instances: int = 8
    prefill_instances: int = 0  # 0: ceil(decode / 3), the paper's 1:3 ratio
    duration_s: float = RULES["simulator.duration_s"].default
    rate_rps: float = 0.0  # 0: rate_per_8 * decode_instances / 8
    rate_per_8: float = RULES["simulator.rate_per_8"].default  # paper: 0.3 per 2 prefill + 6 decode
    workload: str = "sharegpt"  # synthetic name (for file workloads pass a Workload)
    seed: int = 1
    mode: str = RULES["scheduler.mode"].default  # no-migration, current, predicted, oracle, bins:K
    dispatch: str = RULES["scheduler.dispatch"].default
    # current-load only: what a dispatch books until the next view (star.planner.dispatch.booking)
    dispatch_charge: str = RULES["proxy.dispatch_charge"].default
    predictor: str = "noisy"  # what predicted / bins:K modes see: noisy or oracle
    predict_every: int = RULES["predictor.every_k"].default
    predict_latency_s: float = PREDICT_LATENCY_S
    step_base_s: float = 0.008
    step_per_token_s: float = 1.0e-7
    kv_capacity_tokens: int = 200_000
    bytes_per_token: int = 57_344
    bandwidth_gbps: float = RULES["simulator.bandwidth_gbps"].default  # D->D and P->D
    # The fixed cost of a P->D transfer (and of D->D, by default).
    handoff_latency_s: float = RULES["scheduler.handoff_latency_s"].default
    migration_latency_s: float | None = None  # fixed cost of a D->D move; None: handoff_latency_s
    # KV allocation unit, tokens (vLLM's block). A running request holds on average
    # (block - 1) / 2 tokens more than its own (its last block's unused part); 1 = exact.
    kv_block_tokens: int = 1
    # Experiment: the planner sees each request's KV as tokens + that block waste
    # (what a worker counting its last block's unused part would report); False = exact.
    plan_kv_blocks: bool = False
    prefill_base_s: float = 0.015
    prefill_per_token_s: float = 1.25e-4
    tick_s: float = RULES["simulator.tick_s"].default
    warmup_s: float = 0.0  # metrics averaged over [warmup_s, duration_s]
    ttft_slo_s: float = 1.0
    tpot_slo_s: float = 0.025
    max_output_tokens: int = MAX_OUTPUT_TOKENS
    drain: bool = False  # keep running after duration_s until every request finished
    gate: bool = True  # skip planner calls that cannot find an overloaded instance
    planner: PlannerParams = field(default_factory=PlannerParams)

    def __post_init__(self) -> None:
        for name, rule in RULES_BY_FIELD.items():
            value = getattr(self, name)
            if name == "migration_latency_s" and value is None:
                continue
            problem = rule.problem(value)
            if problem:
                raise ConfigError(f"simulator setting {name}={value!r}: {problem}")
        if self.warmup_s >= self.duration_s:
            raise ConfigError(
                f"simulator setting warmup_s={self.warmup_s!r}: must be below duration_s={self.duration_s}"
            )
        try:
            validate_params(self.planner)
        except ValueError as exc:
            raise ConfigError(f"simulator setting planner: {exc}") from None

    @property
    def prefills(self) -> int:
        """Prefill instances: as set, or the paper's 1 per 3 decode instances."""
        return self.prefill_instances or max(1, math.ceil(self.decode_instances / 3))

    @property
    def rate(self) -> float:
        """Arrivals per second: as set, or ``rate_per_8`` per 8 decode instances (paper §6.3)."""
        return self.rate_rps or self.rate_per_8 * self.decode_instances / 8.0

    @property
    def parsed_mode(self) -> Mode:
        """The planner mode this run uses."""
        return Mode.parse(self.mode)

    @property
    def uses_predictor(self) -> bool:
        """Whether decode iterations pay for length predictions (predicted and bins:K)."""
        return self.parsed_mode.kind in (ModeKind.PREDICTED, ModeKind.BINS) or (
            self.dispatch == "predicted"
        )

    @property
    def bandwidth_bytes_per_s(self) -> float:
        """``bandwidth_gbps`` in bytes per second."""
        return self.bandwidth_gbps * 1e9 / 8.0

    def planner_params(self) -> PlannerParams:
        """The planner's parameters: ``planner`` with this run's mode and migration costs."""
        return replace(
            self.planner,
            mode=self.parsed_mode,
            bandwidth_bytes_per_s=self.bandwidth_bytes_per_s,
            handoff_latency_s=self.move_latency_s,
        )

    @property
    def move_latency_s(self) -> float:
        """A D->D migration's fixed cost."""
        if self.migration_latency_s is None:
            return self.handoff_latency_s
        return self.migration_latency_s

    @property
    def block_waste_tokens(self) -> int:
        """Tokens a running request holds beyond its own: half its last block, on average."""
        return (self.kv_block_tokens - 1) // 2

    @property
    def planned_waste_tokens(self) -> int:
        """Tokens the planner adds to each request's KV: the block waste with
        ``plan_kv_blocks``, else 0 (token-exact, as a live worker reports)."""
        return self.block_waste_tokens if self.plan_kv_blocks else 0
