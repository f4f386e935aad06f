"""The worker's vLLM engine: :class:`EngineHandle` runs one ``AsyncLLM`` in
process (built from a :class:`~workers.engine_config.EngineSpec`) and is the
engine the token server drives: generate, release at a step boundary, stats.

A prefill request runs with ``max_tokens=1`` and its last delta carries the
``kv_transfer_params`` a decode worker uses to pull the KV through NIXL. vLLM
facts relied on are in ``docs/vllm-notes.md``. The engine core runs in child
processes, so callers' entry points must be ``__main__``-guarded.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import threading
import time
from collections.abc import AsyncGenerator, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import structlog
from vllm.exceptions import VLLMClientError
from vllm.inputs.engine import tokens_input
from vllm.v1.engine.async_llm import AsyncLLM
from vllm.v1.engine.exceptions import EngineDeadError, EngineGenerateError

from star.ports import reserve
from star.sampling import continuation, migration_blocker
from workers.engine_config import (
    EngineSpec,
    build_engine_args,
    bytes_per_token,
    is_cpu,
    reasoning_hints,
    sampling_params,
    vllm_environment,
)
from workers.engine_stats import StatsCollector
from workers.pacing import DeviceClock, StepTimes
from workers.protocol import (
    BadRequest,
    DuplicateRequest,
    EngineDead,
    EngineFailed,
    GenerateRequest,
    HandoffInfo,
    ReleaseRefused,
    TokenDelta,
    delta_logprobs,
    prompt_scores,
)
from workers.startup import EngineStartError, Setup, core_failure, explain, root_cause
from workers.state import EngineStats, RunningRequest, length_budget
from workers.tap_client import TapClient
from workers.vllm_ext import RELEASE_KEY, release_id

log = structlog.get_logger(__name__)

ENDED_IN_ERROR = (
    "the engine could not continue this request: its structured output left no token to "
    "sample (a grammar that rejects every token allowed_token_ids allows, or one that "
    "does not compile)"
)
"""Why a request vLLM finished with ``finish_reason="error"`` fails. With STAR's
engines (no multimodal inputs, failed KV loads recomputed) vLLM 0.32 ends a
request that way only for its structured output (``Scheduler.update_from_output``:
"grammar rejected tokens"; grammar compile errors): the request's constraints,
so a 400, where vLLM's own server answers 500. Its last token is not sent."""


@dataclass(slots=True)
class _Live:
    """A request the handle is streaming."""

    prompt_tokens: int
    blocker: str | None  # why it cannot migrate (None: it can)
    budget: int | None = None  # tokens it generates in all, when fixed (workers.state)
    generated: int = 0
    started: bool = False  # produced a token: it is decoding, its KV is in place
    release: asyncio.Future[HandoffInfo] | None = None  # a D->D release under way

    @property
    def migratable(self) -> bool:
        return self.blocker is None


def release_refusal(role: str, live: _Live | None, known: bool) -> str | None:
    """Why a request cannot be released now (None: it can)."""
    if role != "decode":
        return "only a decode worker releases requests"
    if live is None or not known:
        return "unknown or finished request"
    if live.blocker is not None:
        return f"not migratable: {live.blocker}"
    if not live.started:
        return "not decoding yet"
    if live.release is not None:
        return "already releasing"
    return None


def handoff(live: _Live, params: Mapping[str, Any]) -> HandoffInfo:
    """The HANDOFF of a released request: the connector's params and the tokens it covers."""
    kv = {k: v for k, v in params.items() if k not in (RELEASE_KEY, "star_num_tokens")}
    return HandoffInfo(kv_transfer_params=kv, num_tokens=live.prompt_tokens + live.generated)


def _settle(live: _Live, result: HandoffInfo | ReleaseRefused) -> None:
    fut = live.release
    if fut is None or fut.done():
        return
    if isinstance(result, HandoffInfo):
        fut.set_result(result)
    else:
        fut.set_exception(result)
        fut.exception()  # retrieved: nobody may be waiting any more


_BUILD_LOCK = threading.Lock()  # engines are built one at a time: the environment is global


def _set_environ(values: Mapping[str, str | None]) -> None:
    for key, value in values.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


@contextlib.contextmanager
def _environ(values: Mapping[str, str | None]) -> Iterator[None]:
    """Set (None: unset) environment variables for the duration of an engine start."""
    saved = {k: os.environ.get(k) for k in values}
    _set_environ(values)
    try:
        yield
    finally:
        _set_environ(saved)


def _already_shut_down(timeout: float | None = None) -> None:
    """``AsyncLLM.shutdown`` once :meth:`EngineHandle.shutdown` has run it."""


class EngineHandle:
    """A running engine: generate, abort, stats, shutdown.

    Implements :class:`workers.protocol.Engine` for the token server. Build it
    with :meth:`start`; stop it with :meth:`shutdown`.
    """

    def __init__(
        self, llm: AsyncLLM, spec: EngineSpec, collector: StatsCollector, nixl_port: int
    ) -> None:
        self.llm = llm
        self.spec = spec
        self.collector = collector
        self.nixl_port = nixl_port
        config = llm.vllm_config
        self.block_size = int(config.cache_config.block_size)
        # vLLM's block pool keeps one null block out of use (block_pool.py get_usage).
        self.num_blocks = max(int(config.cache_config.num_gpu_blocks or 0) - 1, 0)
        self.bytes_per_token = bytes_per_token(config)
        self.max_model_len = int(config.model_config.max_model_len)
        self._live: dict[str, _Live] = {}
        self._closed = False
        self.tap = TapClient(llm)
        self.paced = False
        # A seeded request can be skipped ahead exactly on this engine's sampler
        # (workers.continuation; set at start).
        self.seeded_resume = True

    @property
    def role(self) -> str:
        return self.spec.role

    @property
    def model(self) -> str:
        return self.spec.model

    @classmethod
    def build(cls, spec: EngineSpec) -> EngineHandle:
        """Build the engine (blocking; spawns the engine process). Prefer :meth:`start`."""
        cpu = is_cpu(spec)
        args = build_engine_args(spec, cpu)
        # Held until the engine's side channel listens on it (star.ports.reserve).
        held = None if spec.nixl_port else reserve(spec.nixl_host)
        nixl_port = int(held.getsockname()[1]) if held is not None else spec.nixl_port
        env = vllm_environment(spec, cpu, nixl_port, os.environ, len(os.sched_getaffinity(0)))
        collector = StatsCollector()
        t0 = time.monotonic()
        with (
            held if held is not None else contextlib.nullcontext(),
            _BUILD_LOCK,
            core_failure() as failure,
            _environ({**env, **failure.environ}),
        ):
            try:
                config = args.create_engine_config()
                llm = AsyncLLM.from_vllm_config(
                    config,
                    stat_loggers=[lambda _config, _index: collector],
                    disable_log_stats=True,
                )
            except Exception as exc:
                setup = Setup(
                    spec.kv_cache_space_gib, spec.max_model_len, spec.gpu_memory_utilization, cpu
                )
                raise EngineStartError(explain(failure.cause() or root_cause(exc), setup)) from exc
        log.info(
            "engine_started",
            role=spec.role,
            model=spec.model,
            seconds=round(time.monotonic() - t0, 1),
            nixl_port=nixl_port,
            blocks=config.cache_config.num_gpu_blocks,
            block_size=config.cache_config.block_size,
        )
        return cls(llm, spec, collector, nixl_port)

    @classmethod
    async def start(cls, spec: EngineSpec) -> EngineHandle:
        """Build the engine in a thread so the event loop keeps running meanwhile."""
        loop = asyncio.get_running_loop()
        future = loop.run_in_executor(None, cls.build, spec)
        try:
            handle = await asyncio.shield(future)
        except asyncio.CancelledError:
            # The build cannot be interrupted; shut the engine down once it exists.
            def _discard(f: asyncio.Future[EngineHandle]) -> None:
                if not f.cancelled() and f.exception() is None:
                    f.result().llm.shutdown()

            future.add_done_callback(_discard)
            raise
        try:
            # Before any request: a seeded one with a chunked prompt kills a CPU engine without it.
            await handle.llm.collective_rpc("star_seeded_install")
            if spec.true_continuation:
                hooks = await handle.llm.collective_rpc("star_continuation_install")
                handle.seeded_resume = all(bool(h["seeded"]) for h in hooks)
        except BaseException:
            await handle.shutdown()
            raise
        return handle

    # -- requests -------------------------------------------------------------------------

    async def generate(self, request: GenerateRequest) -> AsyncGenerator[TokenDelta, None]:
        """Run ``request``; yield its token deltas, the last with ``finish_reason``.

        Cancelling the consumer, or closing this generator early, aborts the
        request in the engine and frees its KV (vLLM's ``AsyncLLM.generate``
        does that on ``CancelledError``/``GeneratorExit``).
        """
        if self._closed:
            raise EngineDead("the engine is shut down")
        rid = request.request_id
        if rid in self._live:
            raise DuplicateRequest(f"request {rid!r} is already running on this worker")
        prompt = list(request.prompt_token_ids)
        if not prompt:
            raise BadRequest("prompt_token_ids is empty")
        resume = request.resume and 0 < request.continued < len(prompt)
        blocker = migration_blocker(
            request.sampling, resume=self.spec.true_continuation, seeded=self.seeded_resume
        )
        # The request as this leg counts it: a continuation's prompt ends with
        # the tokens generated before, its budgets reduced by them.
        sampling = request.sampling
        if request.resume:
            try:
                sampling = continuation(request.sampling, request.continued)
            except (ValueError, KeyError, TypeError) as exc:
                raise BadRequest(f"bad continuation: {exc}") from None
        if resume and self.spec.true_continuation:
            # docs/design.md §5.2: original prompt and sampling, the tokens as outputs.
            params = sampling_params(request, self.role)
            engine_prompt = prompt[: -request.continued]
        else:
            params = sampling_params(
                dataclasses.replace(request, sampling=sampling, resume=False), self.role
            )
            engine_prompt = prompt
        budget = (
            length_budget(sampling, len(prompt), self.max_model_len)
            if self.role == "decode"
            else None
        )
        hints = reasoning_hints(request)
        live = _Live(len(prompt), blocker, budget)
        self._live[rid] = live
        try:
            async with contextlib.aclosing(
                self.llm.generate(tokens_input(engine_prompt), params, rid, **hints)
            ) as outputs:
                async for out in outputs:
                    completion = out.outputs[0]
                    new = list(completion.token_ids)
                    live.generated += len(new)
                    live.started = True
                    finished = bool(out.finished)
                    scores = delta_logprobs(completion.logprobs, len(new), params.logprobs)
                    if params.prompt_logprobs is not None:
                        prompt_part = prompt_scores(out.prompt_logprobs, len(engine_prompt))
                        if prompt_part is not None:
                            scores["prompt"] = prompt_part
                    if finished and (out.kv_transfer_params or {}).get(RELEASE_KEY) is not None:
                        # Released (D->D): the stream ends here without a final delta.
                        if new:
                            yield TokenDelta(
                                token_ids=new, num_prompt_tokens=live.prompt_tokens, **scores
                            )
                        _settle(live, handoff(live, out.kv_transfer_params or {}))
                        return
                    if finished and completion.finish_reason == "error":
                        raise BadRequest(ENDED_IN_ERROR)
                    yield TokenDelta(
                        token_ids=new,
                        finish_reason=(completion.finish_reason or "stop") if finished else None,
                        stop_reason=completion.stop_reason if finished else None,
                        kv_transfer_params=out.kv_transfer_params if finished else None,
                        num_prompt_tokens=live.prompt_tokens,
                        **scores,
                    )
        except EngineDeadError as exc:
            raise EngineDead(f"engine died: {exc}") from exc
        except EngineGenerateError as exc:
            raise EngineFailed(f"engine failed the request: {exc.__cause__ or exc}") from exc
        except (VLLMClientError, ValueError) as exc:
            raise BadRequest(str(exc)) from exc
        finally:
            self._live.pop(rid, None)
            _settle(live, ReleaseRefused("the request finished before it could be released"))

    async def abort(self, request_id: str) -> None:
        """Abort ``request_id`` in the engine (frees its KV); unknown ids are ignored."""
        await self.llm.abort(request_id)

    async def release(self, request_id: str, migration: str) -> HandoffInfo:
        """Stop ``request_id`` at the next step boundary with its KV held (docs/design.md §5.1).

        Returns where the KV is held once the engine has released it; raises
        :class:`ReleaseRefused` when it cannot be (see :func:`release_refusal`)
        or when the request ends first. The proxy times the release out by
        aborting the stream.
        """
        live = self._live.get(request_id)
        internal = self.llm.output_processor.external_req_ids.get(request_id) or []
        reason = release_refusal(self.role, live, bool(internal))
        if reason is not None:
            raise ReleaseRefused(reason)
        assert live is not None
        live.release = asyncio.get_running_loop().create_future()
        await self.llm.engine_core.abort_requests_async([release_id(internal[-1], migration)])
        info = await asyncio.shield(live.release)
        # The predictor's state goes with the KV: as of the last report (at
        # most one round old). Asking the engine for it here would lengthen
        # every handoff (measured: +1-2 ms release -> handoff); a request
        # released before its first report brings none.
        return dataclasses.replace(info, fusion=self.tap.fusion.get(request_id))

    # -- numbers --------------------------------------------------------------------------

    def stats(self) -> EngineStats:
        """A snapshot for reports (see :class:`workers.state.EngineStats`)."""
        c = self.collector
        running = tuple(
            RunningRequest(
                id=rid,
                prompt_tokens=live.prompt_tokens,
                generated=live.generated,
                migratable=live.migratable,
                budget=live.budget,
            )
            for rid, live in self._live.items()
            if live.started
        )
        return EngineStats(
            ts=time.monotonic(),
            block_size=self.block_size,
            num_blocks=self.num_blocks,
            bytes_per_token=self.bytes_per_token,
            kv_usage=c.kv_usage,
            running=running,
            waiting=len(self._live) - len(running),
            steps=c.steps,
            decode_steps=c.decode_steps,
            decode_time_s=c.decode_time_s,
            preemptions=c.preemptions,
        )

    async def wait_decode_steps(self, n: int, max_wait_s: float) -> int:
        """Wait for ``n`` more decode steps (or ``max_wait_s``); returns how many ran.

        The report loop's clock: "every k decode steps and at least every second".
        """
        return await self.collector.wait_decode_steps(n, max_wait_s)

    async def install_tap(
        self, predict_every: int, checkpoint: str = "", collect: bool = False
    ) -> int:
        """Start the hidden-state tap (every ``predict_every`` steps); returns the hidden size."""
        return await self.tap.install(predict_every, checkpoint, collect)

    async def install_pacer(self, clock: DeviceClock) -> None:
        """Time every model step, padded to an emulated device's time if ``clock.base_s`` > 0
        (:mod:`workers.pacing`)."""
        await self.llm.collective_rpc(
            "star_pace_install", args=(clock.base_s, clock.per_token_s, clock.prefill_per_token_s)
        )
        self.paced = True

    async def step_times(self) -> StepTimes:
        """Cumulative model steps, their wall time and its padding; zeros before install_pacer."""
        if not self.paced:
            return StepTimes()
        stats = (await self.llm.collective_rpc("star_pace_stats"))[0]
        return StepTimes(int(stats["steps"]), float(stats["step_s"]), float(stats["padded_s"]))

    async def predictions(self) -> dict[str, float]:
        """R-hat now per running request id (the tap's last round, aged by the tokens since)."""
        generated = {rid: live.generated for rid, live in self._live.items() if live.started}
        return await self.tap.predictions(generated)

    @property
    def num_live(self) -> int:
        """Requests being streamed (running or waiting)."""
        return len(self._live)

    @property
    def dead(self) -> bool:
        """The engine core died under us (vLLM noticed; not our :meth:`shutdown`)."""
        return not self._closed and bool(self.llm.errored)

    async def shutdown(self) -> None:
        """Stop the engine process (in a thread: vLLM's shutdown blocks for seconds)."""
        if self._closed:
            return
        self._closed = True
        handler = self.llm.output_handler
        if handler is not None and not self._live:
            # Nobody waits for outputs: stop the handler first, or it logs the
            # engine process's exit as an EngineDeadError.
            handler.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await handler
        await asyncio.to_thread(self.llm.shutdown)
        # AsyncLLM.__del__ calls shutdown() again. After a request has run, the
        # AsyncLLM sits in a reference cycle that only the collector frees,
        # often at interpreter exit, when vLLM's module globals are already
        # None: "Exception ignored in AsyncLLM.__del__ ... TypeError". It is
        # shut down; the second call (an instance attribute, found first) does
        # nothing.
        self.llm.shutdown = _already_shut_down  # type: ignore[method-assign]
        log.info("engine_stopped", role=self.role)
