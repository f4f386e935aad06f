"""The stat logger vLLM calls after every engine step: it keeps what a report
needs (KV use, step times, decode steps) and wakes whoever waits for steps."""

from __future__ import annotations

import asyncio
import contextlib

import structlog
from vllm.config import VllmConfig
from vllm.v1.metrics.loggers import StatLoggerBase
from vllm.v1.metrics.stats import IterationStats, MultiModalCacheStats, SchedulerStats

from star.aio import deadline

log = structlog.get_logger(__name__)


class StatsCollector(StatLoggerBase):
    """Keeps what reports need from vLLM's per-step stats (a custom stat logger).

    ``AsyncLLM``'s output handler calls :meth:`record` in the event loop for
    every batch of engine outputs, each carrying the scheduler stats of one
    engine step (with ``enable_logging_iteration_details``, its execution time).
    """

    def __init__(self, vllm_config: VllmConfig | None = None, engine_index: int = 0) -> None:
        self.kv_usage = 0.0
        self.num_running = 0
        self.num_waiting = 0
        self.steps = 0
        self.decode_steps = 0
        self.decode_time_s = 0.0
        self.preemptions = 0
        self.generation_tokens = 0
        self.prompt_tokens_computed = 0  # prefilled here
        self.prompt_tokens_external = 0  # loaded through the KV connector (NIXL)
        self._waiters: list[tuple[int, asyncio.Future[None]]] = []

    def record(
        self,
        scheduler_stats: SchedulerStats | None,
        iteration_stats: IterationStats | None,
        mm_cache_stats: MultiModalCacheStats | None = None,
        engine_idx: int = 0,
    ) -> None:
        if scheduler_stats is not None:
            self.kv_usage = scheduler_stats.kv_cache_usage
            self.num_running = scheduler_stats.num_running_reqs
            self.num_waiting = (
                scheduler_stats.num_waiting_reqs + scheduler_stats.num_skipped_waiting_reqs
            )
            details = scheduler_stats.iteration_details
            if details is not None and not details.is_dummy:
                self.steps += 1
                if details.num_generation_requests > 0:
                    self.decode_steps += 1
                    self.decode_time_s += details.elapsed_ms / 1000.0
                    self._wake()
        if iteration_stats is not None:
            self.preemptions += iteration_stats.num_preempted_reqs
            self.generation_tokens += iteration_stats.num_generation_tokens
            prompt = iteration_stats.prompt_token_stats
            self.prompt_tokens_computed += prompt.computed
            self.prompt_tokens_external += prompt.external_kv_transfer

    def log_engine_initialized(self) -> None:
        pass

    def _wake(self) -> None:
        if not self._waiters:
            return
        keep = []
        for target, fut in self._waiters:
            if fut.done():
                continue
            if self.decode_steps >= target:
                fut.set_result(None)
            else:
                keep.append((target, fut))
        self._waiters = keep

    async def wait_decode_steps(self, n: int, max_wait_s: float) -> int:
        """Wait for ``n`` more decode steps or ``max_wait_s``; returns how many ran."""
        start = self.decode_steps
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append((start + n, fut))
        try:
            with contextlib.suppress(TimeoutError):
                async with deadline(max_wait_s):
                    await fut
        finally:
            fut.cancel()
        return self.decode_steps - start
