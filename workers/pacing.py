"""Emulated device timing: each engine step padded to a device-shaped time.

Engines that share one CPU box are not independent devices: one instance's
load slows every instance, so balancing barely changes anyone's step time.
With pacing on, each decode step takes at least

    t = base + per_token x (tokens in the batch's KV) + prefill x (tokens prefilled)

(paper §5.2, Fig. 3: decode time grows linearly with the batched tokens;
``docs/e2e.md`` derives the defaults), and the engine sleeps out what the
model did not use, so the CPU idles and each instance behaves as its own
device. Numbers measured this way are labelled "emulated device timing".

:class:`DevicePacer` is mixed into vLLM's worker (see
:mod:`workers.extension`); it wraps the model runner's ``execute_model`` and
``sample_tokens``, inside the engine's own step timing, so reports' step
times include the padding.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class DeviceClock:
    """Step time of the emulated device, seconds: ``base + per_token*kv + prefill*new``."""

    base_s: float
    per_token_s: float = 0.0
    prefill_per_token_s: float = 0.0

    def step_s(self, kv_tokens: int, prefill_tokens: int) -> float:
        return (
            self.base_s + self.per_token_s * kv_tokens + self.prefill_per_token_s * prefill_tokens
        )


@dataclass(frozen=True, slots=True)
class StepTimes:
    """Cumulative model steps, their wall time and the padding in it (seconds)."""

    steps: int = 0
    step_s: float = 0.0
    padded_s: float = 0.0

    def since(self, before: StepTimes) -> tuple[float | None, float]:
        """(Mean step time, padding share) over the steps since ``before``; None without steps."""
        steps = self.steps - before.steps
        if steps <= 0:
            return None, 0.0
        wall = self.step_s - before.step_s
        return wall / steps, (self.padded_s - before.padded_s) / wall if wall > 0 else 0.0


def batch_tokens(scheduler_output: Any) -> tuple[int, int]:
    """(Tokens in the KV of the scheduled requests after this step, tokens prefilled in it).

    A decoding request schedules one token; anything beyond that is prefill
    (a new prompt, a recompute after preemption, a migrated request's last
    token).
    """
    scheduled: dict[str, int] = scheduler_output.num_scheduled_tokens
    kv = prefill = 0
    for req in scheduler_output.scheduled_new_reqs:
        n = scheduled.get(req.req_id, 0)
        kv += req.num_computed_tokens + n
        prefill += n
    cached = scheduler_output.scheduled_cached_reqs
    for rid, computed in zip(cached.req_ids, cached.num_computed_tokens, strict=False):
        n = scheduled.get(rid, 0)
        kv += computed + n
        prefill += max(n - 1, 0)
    return kv, prefill


class DevicePacer:
    """Worker-extension methods (prefixed ``star_pace_``)."""

    model_runner: Any  # provided by vLLM's worker class

    def star_pace_install(
        self, base_s: float, per_token_s: float, prefill_per_token_s: float
    ) -> None:
        """Time every step, and pad it to :class:`DeviceClock`'s time unless ``base_s`` is 0.

        Installing again re-configures. The timing is the whole model step,
        ``execute_model`` through ``sample_tokens``: vLLM's own iteration
        time misses ``execute_model`` when the uni executor runs it inline
        (CPU), before its timing window opens.
        """
        if base_s < 0:
            raise ValueError(f"base_s must be >= 0, got {base_s}")
        self._star_clock = DeviceClock(base_s, per_token_s, prefill_per_token_s)
        if getattr(self, "_star_paced", False):
            return
        self._star_paced = True
        self._star_pace = [0, 0.0, 0.0]  # steps, padded s, step s (with padding)
        self._star_step: tuple[float, float] | None = None  # (start, target) of the open step
        runner = self.model_runner
        execute, sample = runner.execute_model, getattr(runner, "sample_tokens", None)
        clock = time.perf_counter

        def execute_model(scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
            started = clock()
            out = execute(scheduler_output, *args, **kwargs)
            if not scheduler_output.total_num_scheduled_tokens:
                return out  # an empty step (nothing scheduled): no device time
            # The batch's tokens only under emulated timing: timing alone is two clock reads.
            device = self._star_clock
            target = device.step_s(*batch_tokens(scheduler_output)) if device.base_s > 0 else 0.0
            self._star_step = (started, target)
            if out is not None or sample is None:
                self._star_finish_step()
            return out

        def sample_tokens(*args: Any, **kwargs: Any) -> Any:
            assert sample is not None
            out = sample(*args, **kwargs)
            self._star_finish_step()
            return out

        runner.execute_model = execute_model
        if sample is not None:
            runner.sample_tokens = sample_tokens

    def _star_finish_step(self) -> None:
        step = self._star_step
        if step is None:
            return
        self._star_step = None
        started, target = step
        pad = target - (time.perf_counter() - started) if target > 0 else 0.0
        if pad > 0:
            time.sleep(pad)
        stats = self._star_pace
        stats[0] += 1
        stats[1] += max(pad, 0.0)
        stats[2] += time.perf_counter() - started

    def star_pace_stats(self) -> dict[str, float]:
        """Cumulative ``steps``, ``padded_s`` and ``step_s`` since install (zeros before)."""
        steps, padded, total = getattr(self, "_star_pace", (0, 0.0, 0.0))
        return {"steps": float(steps), "padded_s": float(padded), "step_s": float(total)}


class PulledKvPacer:
    """Emulated device timing for KV pulls: a pull is reported done no sooner than
    ``per_token_s`` x its tokens after it started (a padded pull).

    On one CPU box NIXL moves a KV cache over loopback in microseconds; a
    device's link (paper §6.3: 25 Gbit/s) takes bytes / bandwidth. The
    request waits for its KV as it would there, while the instance keeps
    decoding its other requests (NIXL transfers overlap decoding, §5.4).
    A failed pull is reported at once.
    """

    def __init__(self, per_token_s: float, block_tokens: int) -> None:
        self.per_token_s = per_token_s
        self.block_tokens = block_tokens
        self.due: dict[str, float] = {}  # request id -> when its emulated transfer ends
        self.held: set[str] = set()  # done pulls not reported yet

    def started(self, reqs_to_recv: Any, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        for rid, meta in reqs_to_recv.items():
            if rid not in self.due:
                blocks = meta.local_block_ids
                # One list of block ids per KV cache group, each covering every token.
                first = blocks[0] if blocks and isinstance(blocks[0], list | tuple) else blocks
                self.due[rid] = now + len(first) * self.block_tokens * self.per_token_s

    def finished(self, recving: set[str], failed: set[str], now: float | None = None) -> set[str]:
        """The pulls to report done now, out of those NIXL finished now or before."""
        now = time.monotonic() if now is None else now
        pending = self.held | recving
        ready = {r for r in pending if r in failed or self.due.get(r, 0.0) <= now}
        self.held = pending - ready
        for rid in ready:
            self.due.pop(rid, None)
        return ready
