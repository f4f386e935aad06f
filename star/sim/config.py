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

from star.planner.types import Mode, ModeKind, PlannerParams
from star.settings import DISPATCH_CHARGES, DISPATCH_POLICIES
from star.sim.predictor import PREDICT_LATENCY_S
from star.sim.workload import MAX_OUTPUT_TOKENS, SYNTHETIC

PREDICTORS = ("noisy", "oracle")


class ConfigError(ValueError):
    """A simulator setting is out of range."""


@dataclass(frozen=True)
class SimConfig:
    """Everything one simulated run depends on (with the seed, fully deterministic)."""

    decode_instances: int = 8
    prefill_instances: int = 0  # 0: ceil(decode / 3), the paper's 1:3 ratio
    duration_s: float = 2000.0
    rate_rps: float = 0.0  # 0: rate_per_8 * decode_instances / 8
    rate_per_8: float = 0.4  # the paper's 0.3 req/s per 2 prefill + 6 decode instances
    workload: str = "sharegpt"  # synthetic name (for file workloads pass a Workload)
    seed: int = 1
    mode: str = "predicted"  # no-migration, current, predicted, oracle, bins:K
    dispatch: str = "current-load"
    # current-load only: what a dispatch books until the next view (star.planner.dispatch.booking)
    dispatch_charge: str = "expected"
    predictor: str = "noisy"  # what predicted / bins:K modes see: noisy or oracle
    predict_every: int = 20
    predict_latency_s: float = PREDICT_LATENCY_S
    step_base_s: float = 0.008
    step_per_token_s: float = 1.0e-7
    kv_capacity_tokens: int = 200_000
    bytes_per_token: int = 57_344
    bandwidth_gbps: float = 25.0  # D->D migration and P->D transfer
    handoff_latency_s: float = 0.025  # fixed cost of a P->D transfer (and of D->D, by default)
    migration_latency_s: float | None = None  # fixed cost of a D->D move; None: handoff_latency_s
    # KV allocation unit, tokens (vLLM's block). A running request holds on average
    # (block - 1) / 2 tokens more than its own (its last block's unused part); 1 = exact.
    kv_block_tokens: int = 1
    # Experiment: the planner sees each request's KV as tokens + that block waste
    # (what a worker counting its last block's unused part would report); False = exact.
    plan_kv_blocks: bool = False
    prefill_base_s: float = 0.015
    prefill_per_token_s: float = 1.25e-4
    tick_s: float = 1.0
    warmup_s: float = 0.0  # metrics averaged over [warmup_s, duration_s]
    ttft_slo_s: float = 1.0
    tpot_slo_s: float = 0.025
    max_output_tokens: int = MAX_OUTPUT_TOKENS
    drain: bool = False  # keep running after duration_s until every request finished
    gate: bool = True  # skip planner calls that cannot find an overloaded instance
    planner: PlannerParams = field(default_factory=PlannerParams)

    def __post_init__(self) -> None:
        def bad(name: str, why: str) -> ConfigError:
            return ConfigError(f"simulator setting {name}={getattr(self, name)!r}: {why}")

        for name in (
            "decode_instances",
            "predict_every",
            "kv_capacity_tokens",
            "kv_block_tokens",
            "bytes_per_token",
            "max_output_tokens",
        ):
            if int(getattr(self, name)) < 1:
                raise bad(name, "must be >= 1")
        if self.prefill_instances < 0:
            raise bad("prefill_instances", "must be >= 0 (0 = decode / 3)")
        for name in ("duration_s", "rate_per_8", "bandwidth_gbps", "tick_s", "step_base_s"):
            value = float(getattr(self, name))
            if not (math.isfinite(value) and value > 0):
                raise bad(name, "must be a finite number > 0")
        for name in (
            "rate_rps",
            "predict_latency_s",
            "step_per_token_s",
            "handoff_latency_s",
            "prefill_base_s",
            "prefill_per_token_s",
            "warmup_s",
            "ttft_slo_s",
            "tpot_slo_s",
        ):
            value = float(getattr(self, name))
            if not (math.isfinite(value) and value >= 0):
                raise bad(name, "must be a finite number >= 0")
        if self.migration_latency_s is not None and not (
            math.isfinite(self.migration_latency_s) and self.migration_latency_s >= 0
        ):
            raise bad("migration_latency_s", "must be a finite number >= 0 (or None)")
        if self.warmup_s >= self.duration_s:
            raise bad("warmup_s", f"must be below duration_s={self.duration_s}")
        if self.dispatch not in DISPATCH_POLICIES:
            raise bad("dispatch", f"expected one of {', '.join(DISPATCH_POLICIES)}")
        if self.dispatch_charge not in DISPATCH_CHARGES:
            raise bad("dispatch_charge", f"expected one of {', '.join(DISPATCH_CHARGES)}")
        if self.workload not in SYNTHETIC:
            raise bad(
                "workload", f"expected one of {', '.join(SYNTHETIC)} (pass a file as a Workload)"
            )
        if self.predictor not in PREDICTORS:
            raise bad("predictor", f"expected one of {', '.join(PREDICTORS)}")
        try:
            Mode.parse(self.mode)
        except ValueError as exc:
            raise ConfigError(f"simulator setting mode={self.mode!r}: {exc}") from None

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
