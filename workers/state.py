"""A worker's report, computed from engine stats without IO (docs/design.md §3, §4).

:class:`EngineStats` is a snapshot the vLLM adapter (:mod:`workers.engine`)
takes of its engine: KV geometry and use, the requests it runs, cumulative
step counters. :func:`build_report` turns two successive snapshots and the
length predictor's latest R-hat per request into a :class:`star.wire.Report`,
including the worker's pre-simulated future load

    L(tau_j) = sum_r c_r(tau_j),  tau_j = j * delta,  j = 0..H,
    c_r(tau) = N(r) + tau  while tau < R-hat(r), else 0,

with R-hat unknown (no prediction yet) read as "keeps going through the
horizon" and a known R-hat clamped to at least one token (a running request
holds its KV now, so L(tau_0) is the current token load) -- the same reading
as the planner's (:mod:`star.planner.trace`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import msgspec

from star.sampling import migration_blocker
from star.wire import Report, RequestLoad

MIN_REMAINING = 1.0
"""A known R-hat below this is raised to it: a running request counts at tau_0."""


@dataclass(frozen=True, slots=True)
class RunningRequest:
    """One request the engine is decoding."""

    id: str
    prompt_tokens: int
    generated: int
    migratable: bool = True
    budget: int | None = None  # tokens it generates in all when fixed (length_budget)

    @property
    def tokens(self) -> int:
        """N(r): prompt + generated tokens, the request's KV footprint."""
        return self.prompt_tokens + self.generated

    @property
    def true_remaining(self) -> int | None:
        """Tokens left to generate, when its length is fixed (None: not known)."""
        return None if self.budget is None else max(self.budget - self.generated, 0)


@dataclass(frozen=True, slots=True)
class EngineStats:
    """A snapshot of one engine; the counters are cumulative since it started.

    ``kv_usage`` is vLLM's block-pool usage (used / usable blocks) as of the
    engine's last step; ``num_blocks`` counts usable blocks (vLLM's null block
    excluded). ``decode_steps`` counts engine steps that decoded at least one
    request and ``decode_time_s`` their summed execution time.
    """

    ts: float  # time.monotonic() of the snapshot
    block_size: int
    num_blocks: int
    bytes_per_token: int
    kv_usage: float
    running: tuple[RunningRequest, ...]
    waiting: int  # requests admitted but not decoding yet (queued, or pulling KV)
    steps: int
    decode_steps: int
    decode_time_s: float
    preemptions: int

    @property
    def capacity_tokens(self) -> int:
        """KV capacity in tokens (usable blocks x block size)."""
        return self.num_blocks * self.block_size

    @property
    def used_blocks(self) -> int:
        return round(self.kv_usage * self.num_blocks)

    @property
    def used_tokens(self) -> int:
        """KV in use in tokens, block-granular (used blocks x block size)."""
        return self.used_blocks * self.block_size

    @property
    def mean_step_time_s(self) -> float:
        """Mean decode step time since the engine started (0 before the first step)."""
        return self.decode_time_s / self.decode_steps if self.decode_steps else 0.0


# SamplingParams keys that never end a request before max_tokens once ignore_eos
# is set. vLLM's check_stop (v1/core/sched/utils.py) skips EOS under ignore_eos,
# and update_from_generation_config adds the generation config's other EOS ids
# to stop_token_ids only without it; stop_token_ids, stop strings, grammars
# and repetition detection still end a request early, so they (or any key not
# listed) make its length unknown.
_NEVER_STOP = frozenset(
    {
        "max_tokens",
        "min_tokens",
        "ignore_eos",
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "logit_bias",
        "allowed_token_ids",
        "presence_penalty",
        "frequency_penalty",
        "repetition_penalty",
        "seed",
        "logprobs",
        "prompt_logprobs",
        "bad_words",
        "include_stop_str_in_output",
        "skip_special_tokens",
        "spaces_between_special_tokens",
        "detokenize",
        "n",
    }
)
_EMPTY_STOPS = frozenset({"stop", "stop_token_ids"})  # fine while empty


def length_budget(
    sampling: Mapping[str, object], prompt_tokens: int, max_model_len: int
) -> int | None:
    """How many tokens a request generates in all, when that is fixed (None: not known).

    Fixed when it ignores EOS, has a ``max_tokens`` and nothing else can stop
    it: then it generates ``max_tokens``, or up to the context length if that
    comes first. A continued (migrated) request's ``max_tokens`` is already
    reduced by the tokens generated before (:func:`star.sampling.continuation`)
    and its prompt holds them, so its budget counts from the continuation on.
    """
    max_tokens = sampling.get("max_tokens")
    if sampling.get("ignore_eos") is not True or type(max_tokens) is not int or max_tokens < 1:
        return None
    for key, value in sampling.items():
        if key in _EMPTY_STOPS:
            if value:
                return None
        elif key not in _NEVER_STOP:
            return None
    return max(min(max_tokens, max_model_len - prompt_tokens), 0)


def is_migratable(sampling: Mapping[str, object]) -> bool:
    """Whether a request's sampling state survives a move (:func:`star.sampling.migration_blocker`)."""
    return migration_blocker(sampling) is None


def grid(delta: int, horizon: int) -> list[float]:
    """tau_j = j * delta for j = 0..H, in decode steps."""
    if delta <= 0 or horizon < 0:
        raise ValueError(f"need delta > 0 and horizon >= 0, got delta={delta}, horizon={horizon}")
    return [float(j * delta) for j in range(horizon + 1)]


def effective_remaining(predicted: float | None) -> float:
    """R-hat as the trace uses it: unknown (None/NaN) -> inf, else at least one token."""
    if predicted is None or math.isnan(predicted):
        return math.inf
    return max(float(predicted), MIN_REMAINING)


def load_trace(
    requests: Iterable[tuple[int, float | None]], delta: int, horizon: int
) -> list[float]:
    """L(tau_0..tau_H) of ``(N(r), R-hat(r))`` pairs (see the module docstring)."""
    taus = grid(delta, horizon)
    out = [0.0] * len(taus)
    for tokens, predicted in requests:
        remaining = effective_remaining(predicted)
        for j, tau in enumerate(taus):
            if tau >= remaining:
                break  # taus increase: the request is gone from here on
            out[j] += tokens + tau
    return out


def mean_step_time(current: EngineStats, previous: EngineStats | None) -> float:
    """Mean decode step time between two snapshots.

    Falls back to the mean since start when no decode step ran in between (an
    idle instance still reports its last known speed, which C_mig needs).
    """
    if previous is not None:
        steps = current.decode_steps - previous.decode_steps
        if steps > 0:
            return (current.decode_time_s - previous.decode_time_s) / steps
    return current.mean_step_time_s


def request_loads(
    running: Sequence[RunningRequest], predictions: Mapping[str, float]
) -> list[RequestLoad]:
    """The per-request part of a report, R-hat from ``predictions`` (absent = None)."""
    return [
        RequestLoad(
            id=r.id,
            tokens=r.tokens,
            generated=r.generated,
            predicted_remaining=predictions.get(r.id),
            migratable=r.migratable,
            true_remaining=r.true_remaining,
        )
        for r in running
    ]


def build_report(
    stats: EngineStats,
    previous: EngineStats | None,
    *,
    instance: str,
    role: str,
    seq: int,
    ts: float,
    address: str,
    predictions: Mapping[str, float],
    delta: int,
    horizon: int,
    predictor: bool | None = None,
    in_flight: Sequence[str] = (),
    draining: bool = False,
    step_time_s: float | None = None,
    pad_share: float = 0.0,
    refused_peers: int = 0,
    incarnation: int | msgspec.UnsetType = msgspec.UNSET,
) -> Report:
    """The report of a worker whose engine is in state ``stats``.

    ``previous`` is the snapshot of the previous report (None for the first):
    the step time is the mean over the steps in between. ``ts`` is wall-clock
    time (the bus's), ``predictions`` maps request id to R-hat, and
    ``delta``/``horizon`` must be the scheduler's (it ignores a trace of any
    other length). ``preemptions`` is cumulative since the engine started.
    ``predictor``: whether a length predictor is loaded (None: not said).
    ``draining``: the worker is stopping and takes no new streams.
    ``step_time_s``: the mean model-step time since the last report as the
    worker timed it (:mod:`workers.pacing`); None: from the engine's stats.
    ``pad_share``: the share of the step time that emulated device timing padded.
    ``refused_peers``: token-protocol peers that failed the handshake so far.
    ``incarnation``: this run of the worker process (star.report_gate).
    """
    loads = request_loads(stats.running, predictions)
    trace = load_trace(((r.tokens, r.predicted_remaining) for r in loads), delta, horizon)
    return Report(
        instance=instance,
        role=role,
        seq=seq,
        ts=ts,
        address=address,
        capacity_tokens=stats.capacity_tokens,
        used_tokens=stats.used_tokens,
        bytes_per_token=stats.bytes_per_token,
        step_time_s=mean_step_time(stats, previous) if step_time_s is None else step_time_s,
        delta=delta,
        trace=trace,
        requests=loads,
        in_flight=list(in_flight),
        predictor=predictor,
        waiting=stats.waiting,
        preemptions=stats.preemptions,
        draining=draining,
        pad_share=pad_share,
        refused_peers=refused_peers,
        incarnation=incarnation,
    )
