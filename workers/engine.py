"""One vLLM engine (``AsyncLLM``, in process) behind the worker's engine interface.

:class:`EngineSpec` says what to build (model, role, KV cache size, extra
engine arguments); :meth:`EngineHandle.start` builds it with vLLM's
``NixlConnector`` (``kv_role="kv_both"``: a decode instance will also be a
D->D source) and a stat logger that keeps the numbers a report needs.

* Prefill role: every request runs with ``max_tokens=1`` and
  ``kv_transfer_params={"do_remote_decode": True}``; its last delta carries
  the ``kv_transfer_params`` (``do_remote_prefill``, remote block ids, engine
  id, side-channel host/port) that a decode worker consumes to pull the KV
  through NIXL.
* Decode role: a request with those ``kv_transfer_params`` pulls the prompt's
  KV from the prefill instance and decodes; without them it prefills itself.

vLLM facts this relies on are in ``docs/vllm-notes.md`` (with file/line
references into the installed 0.32 source). The engine core runs in child
processes started with vLLM's multiprocessing context (fork on CPU, spawn once
CUDA is initialised): callers' entry points must be ``__main__``-guarded.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import threading
import time
from collections.abc import AsyncGenerator, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import structlog
from vllm import SamplingParams
from vllm.config import KVTransferConfig, VllmConfig
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.exceptions import VLLMClientError
from vllm.inputs.engine import tokens_input
from vllm.sampling_params import RequestOutputKind, StructuredOutputsParams
from vllm.utils.torch_utils import get_dtype_size, kv_cache_dtype_str_to_dtype
from vllm.v1.engine.async_llm import AsyncLLM
from vllm.v1.engine.exceptions import EngineDeadError, EngineGenerateError
from vllm.v1.metrics.loggers import StatLoggerBase
from vllm.v1.metrics.stats import IterationStats, MultiModalCacheStats, SchedulerStats

from star.aio import deadline
from star.ports import free_port
from star.sampling import migration_blocker
from star.settings import WorkerSettings
from workers.extension import QUALNAME as WORKER_EXTENSION
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
)
from workers.startup import EngineStartError, Setup, core_failure, explain, root_cause
from workers.state import EngineStats, RunningRequest, length_budget
from workers.tap import CONTINUED_KEY, FUSION_KEY, TapClient
from workers.vllm_ext import RELEASE_KEY, release_id

log = structlog.get_logger(__name__)

ROLES = ("prefill", "decode")
GiB = 1 << 30
RELEASE_TTL_S = 30
"""A released request's blocks are freed after this long if no target reads them."""

# Keys of ``Generate.sampling`` the worker owns: the output is streamed as deltas
# of token ids (the proxy detokenises), and the KV handoff is set by role.
_RESERVED_SAMPLING = ("output_kind", "extra_args")


class EngineConfigError(ValueError):
    """The engine cannot be built as configured; ``str()`` names the bad value."""


# -- what to build ----------------------------------------------------------------------


@dataclass(frozen=True)
class EngineSpec:
    """Everything needed to build one engine; see :meth:`from_settings`.

    ``engine_args`` are extra ``AsyncEngineArgs`` fields (``enforce_eager``,
    ``dtype``, ``block_size``, ...) and win over the values derived here.
    ``nixl_port`` is NIXL's side-channel port (0 = a free one) and
    ``nixl_host`` the address other instances reach it at. ``device`` is
    ``"auto"`` (vLLM's platform), ``"cpu"`` or ``"cuda"``.
    """

    model: str
    role: str = "decode"
    max_model_len: int = 4096
    kv_cache_space_gib: float = 1.0
    gpu_memory_utilization: float = 0.3
    engine_args: Mapping[str, Any] = field(default_factory=dict)
    nixl_host: str = "127.0.0.1"
    nixl_port: int = 0
    device: str = "auto"
    cpu_threads: int = 0

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise EngineConfigError(f"role must be prefill or decode, got {self.role!r}")
        if self.device not in ("auto", "cpu", "cuda"):
            raise EngineConfigError(f"device must be auto, cpu or cuda, got {self.device!r}")
        if not self.model:
            raise EngineConfigError("model is empty")

    @classmethod
    def from_settings(cls, settings: WorkerSettings, **overrides: Any) -> EngineSpec:
        """The spec of a worker configured by ``settings`` (``overrides`` win).

        An empty ``settings.model`` means the bundled tiny demo model.
        """
        model = settings.model
        if not model:
            from star.model import tiny_model_path

            model = str(tiny_model_path())
        values: dict[str, Any] = {
            "model": model,
            "role": settings.role,
            "max_model_len": settings.max_model_len,
            "kv_cache_space_gib": settings.kv_cache_space_gib,
            "gpu_memory_utilization": settings.gpu_memory_utilization,
            "engine_args": parse_engine_args(settings.engine_args),
            "nixl_host": settings.host,
            "cpu_threads": settings.cpu_threads,
        }
        values.update(overrides)
        return cls(**values)


def parse_engine_args(items: Sequence[str]) -> dict[str, Any]:
    """``["enforce_eager=true", "--block-size=16"]`` -> ``{"enforce_eager": True, "block_size": 16}``.

    Values are read as JSON when they parse (numbers, booleans, objects),
    otherwise kept as strings; keys may be spelled like vLLM's flags.
    """
    out: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        key = key.strip().lstrip("-").replace("-", "_")
        if not sep or not key:
            raise EngineConfigError(f"engine argument {item!r} is not KEY=VALUE")
        try:
            value: Any = json.loads(raw)
        except json.JSONDecodeError:
            value = raw
        out[key] = value
    return out


def is_cpu(spec: EngineSpec) -> bool:
    """Whether the engine will run on CPU (``device="auto"`` asks vLLM's platform)."""
    if spec.device != "auto":
        return spec.device == "cpu"
    from vllm.platforms import current_platform

    return bool(current_platform.is_cpu())


def build_engine_args(spec: EngineSpec, cpu: bool) -> AsyncEngineArgs:
    """The ``AsyncEngineArgs`` of ``spec`` (no IO; see docs/vllm-notes.md).

    On CPU the KV cache size is ``kv_cache_memory_bytes`` (what
    ``VLLM_CPU_KVCACHE_SPACE`` sets, but fractional GiB allowed) and NIXL gets
    one UCX thread: its default of 4 busy threads starves the model's OpenMP
    thread on a small machine (decode steps went from ~2 ms to ~1 s).
    """
    extra: dict[str, Any] = {}
    # vLLM's NIXL connector, plus the D->D release (workers/vllm_ext.py, DESIGN §5).
    kv: dict[str, Any] = {
        "kv_connector": "StarNixlConnector",
        "kv_connector_module_path": "workers.vllm_ext",
        "kv_role": "kv_both",
        # A failed KV pull (e.g. NIXL's 5 s handshake timeout on a loaded host)
        # recomputes the prompt locally instead of failing the request.
        "kv_load_failure_policy": "recompute",
    }
    if spec.role == "decode":
        extra.update(bidirectional_kv_xfer=True, decoder_kv_blocks_ttl=RELEASE_TTL_S)
    if cpu:
        kv["kv_buffer_device"] = "cpu"
        extra["num_threads"] = 1
    user = dict(spec.engine_args)
    user_kv = user.pop("kv_transfer_config", None)
    if isinstance(user_kv, Mapping):
        extra.update(user_kv.get("kv_connector_extra_config") or {})
        kv.update({k: v for k, v in user_kv.items() if k != "kv_connector_extra_config"})
    elif user_kv is not None:
        raise EngineConfigError(
            f"engine argument kv_transfer_config must be a JSON object, got {user_kv!r}"
        )
    kv["kv_connector_extra_config"] = extra

    values: dict[str, Any] = {
        "model": spec.model,
        "max_model_len": spec.max_model_len,
        "gpu_memory_utilization": spec.gpu_memory_utilization,
        "kv_transfer_config": KVTransferConfig(**kv),
        # Per-step execution time reaches our stat logger only with this on.
        "enable_logging_iteration_details": True,
        # Our stat logger replaces vLLM's periodic log lines.
        "disable_log_stats": True,
        "enable_log_requests": False,
        "scheduler_cls": "workers.vllm_ext.StarScheduler",
        # The hidden-state tap (workers/tap.py); idle until install_tap().
        "worker_extension_cls": WORKER_EXTENSION,
    }
    if cpu:
        values["kv_cache_memory_bytes"] = int(spec.kv_cache_space_gib * GiB)
        # torch.compile warm-up takes minutes on a small CPU machine (several
        # engines compiling at once saturated 2 cores for > 4 min in `star up`);
        # eager mode starts in seconds. `--engine-arg enforce_eager=false` undoes it.
        values["enforce_eager"] = True
        # vLLM CPU downcasts float32 checkpoints to bfloat16; keep the
        # checkpoint's precision so greedy outputs match other runs exactly.
        values["dtype"] = "float32"
        # The model runs inside the engine-core process (see vllm_environment):
        # no VLLM::Worker process whose shared-memory queue reader busy-spins
        # for 1 s after every step, and one IPC hop less per step.
        values["distributed_executor_backend"] = "uni"
    known = {f.name for f in dataclasses.fields(AsyncEngineArgs)}
    unknown = sorted(set(user) - known)
    if unknown:
        raise EngineConfigError(f"unknown vLLM engine argument(s): {', '.join(unknown)}")
    values.update(user)
    try:
        return AsyncEngineArgs(**values)
    except (TypeError, ValueError) as exc:
        raise EngineConfigError(f"invalid vLLM engine arguments: {exc}") from None


def vllm_environment(
    spec: EngineSpec, cpu: bool, nixl_port: int, env: Mapping[str, str], cpu_count: int
) -> dict[str, str | None]:
    """Environment variables vLLM reads at engine start (it has no arguments for them).

    * ``VLLM_NIXL_SIDE_CHANNEL_HOST/PORT``: NIXL's handshake listener; one port
      per engine on a host.
    * ``VLLM_CPU_KVCACHE_SPACE``: vLLM reads it as whole GiB and lets it
      override ``kv_cache_memory_bytes``; it is set to the same size when whole,
      else removed (None) so the exact byte count stands ("" crashes vLLM's
      environment cache in the worker process).
    * ``VLLM_CPU_NUM_OF_RESERVED_CPU``: with a KV connector vLLM reserves two
      cores (scheduler + NIXL) and binds OpenMP to the rest -- or to *all*
      cores when that leaves none, so the model's threads fight the
      scheduler's. On a machine of two cores or fewer one core is reserved.
      An operator's own value is kept.
    * ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` on CPU with the ``uni`` executor
      (the default there): vLLM's CPU platform otherwise turns ``uni`` into
      ``mp``, which adds a worker process per engine whose shared-memory
      queue reader spins a core for a second after every step -- three idle
      engines drove a 2-core machine to a load average of 20-50. The front
      end still runs the engine core in its own process (``AsyncLLM`` always
      does), so only the extra worker process goes.
    * ``OMP_NUM_THREADS`` on CPU from ``spec.cpu_threads`` (an operator's own
      value is kept). vLLM's default, one OpenMP thread per core for every
      engine, oversubscribed a host running several: their spinning threads
      starved each other and the proxy, whose event loop then stalled for
      seconds -- the multi-second tail of ``star bench migration``. (With the
      ``uni`` executor vLLM ignores ``VLLM_CPU_OMP_THREADS_BIND``.)
    """
    out: dict[str, str | None] = {
        "VLLM_NIXL_SIDE_CHANNEL_HOST": spec.nixl_host,
        "VLLM_NIXL_SIDE_CHANNEL_PORT": str(nixl_port),
    }
    if cpu:
        gib = spec.kv_cache_space_gib
        out["VLLM_CPU_KVCACHE_SPACE"] = str(int(gib)) if float(gib).is_integer() else None
        if "VLLM_CPU_NUM_OF_RESERVED_CPU" not in env and cpu_count <= 2:
            out["VLLM_CPU_NUM_OF_RESERVED_CPU"] = "1"
        if spec.engine_args.get("distributed_executor_backend", "uni") == "uni":
            out["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        if spec.cpu_threads and "OMP_NUM_THREADS" not in env:
            out["OMP_NUM_THREADS"] = str(spec.cpu_threads)
    return out


def bytes_per_token(config: VllmConfig) -> int:
    """KV bytes one token occupies across the whole engine (all layers, all ranks).

    2 (K and V) x layers x KV heads x head size x dtype size; MLA models keep
    one latent per layer instead. Hybrid (Mamba) models are not covered.
    """
    mc = config.model_config
    dtype = kv_cache_dtype_str_to_dtype(config.cache_config.cache_dtype, mc)
    size = int(get_dtype_size(dtype))
    layers = int(mc.get_total_num_hidden_layers())
    if mc.use_mla:
        return layers * int(mc.get_head_size()) * size
    return layers * 2 * int(mc.get_total_num_kv_heads()) * int(mc.get_head_size()) * size


def sampling_params(request: GenerateRequest, role: str) -> SamplingParams:
    """vLLM sampling parameters for ``request`` on a ``role`` worker (raises :class:`BadRequest`).

    Output is streamed as deltas of token ids; detokenisation is the proxy's,
    so the engine detokenises only when ``stop`` strings are asked for. A
    prefill worker computes one token and keeps the KV for a decode worker
    (``do_remote_decode``); ``kv_transfer_params`` reach the connector through
    ``extra_args`` (as vLLM's OpenAI server passes them).
    """
    kwargs = dict(request.sampling)
    reserved = [k for k in _RESERVED_SAMPLING if k in kwargs]
    if reserved:
        raise BadRequest(f"sampling may not set {', '.join(reserved)}")
    if kwargs.get("n", 1) != 1:
        raise BadRequest("n must be 1 on the token protocol (the proxy fans out choices)")
    structured = kwargs.get("structured_outputs")
    if isinstance(structured, Mapping):
        try:
            kwargs["structured_outputs"] = StructuredOutputsParams(**structured)
        except (TypeError, ValueError, VLLMClientError) as exc:
            raise BadRequest(f"bad structured_outputs: {exc}") from None
    kwargs.setdefault("detokenize", bool(kwargs.get("stop")))
    kv = dict(request.kv_transfer_params) if request.kv_transfer_params else {}
    if role == "prefill":
        kwargs["max_tokens"] = 1
        kwargs["min_tokens"] = 0
        kv.setdefault("do_remote_decode", True)
    extra: dict[str, Any] = {"kv_transfer_params": kv} if kv else {}
    if request.continued > 0:
        # The tap (workers/tap.py) reads it: this request's first row is mid-answer,
        # and it may continue the source's fusion.
        extra[CONTINUED_KEY] = int(request.continued)
        if request.fusion is not None:
            extra[FUSION_KEY] = [float(x) for x in request.fusion]
    try:
        return SamplingParams(
            **kwargs,
            output_kind=RequestOutputKind.DELTA,
            extra_args=extra or None,
        )
    except (TypeError, ValueError, VLLMClientError) as exc:
        raise BadRequest(f"bad sampling parameters: {exc}") from None


# -- the stat logger ------------------------------------------------------------------------


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


# -- the engine ----------------------------------------------------------------------------


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
        nixl_port = spec.nixl_port or free_port(spec.nixl_host)
        env = vllm_environment(spec, cpu, nixl_port, os.environ, len(os.sched_getaffinity(0)))
        collector = StatsCollector()
        t0 = time.monotonic()
        with _BUILD_LOCK, core_failure() as failure, _environ({**env, **failure.environ}):
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
            return await asyncio.shield(future)
        except asyncio.CancelledError:
            # The build cannot be interrupted; shut the engine down once it exists.
            def _discard(f: asyncio.Future[EngineHandle]) -> None:
                if not f.cancelled() and f.exception() is None:
                    f.result().llm.shutdown()

            future.add_done_callback(_discard)
            raise

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
        params = sampling_params(request, self.role)
        prompt = list(request.prompt_token_ids)
        if not prompt:
            raise BadRequest("prompt_token_ids is empty")
        budget = (
            length_budget(request.sampling, len(prompt), self.max_model_len)
            if self.role == "decode"
            else None
        )
        live = _Live(len(prompt), migration_blocker(request.sampling), budget)
        self._live[rid] = live
        try:
            async with contextlib.aclosing(
                self.llm.generate(tokens_input(prompt), params, rid)
            ) as outputs:
                async for out in outputs:
                    completion = out.outputs[0]
                    new = list(completion.token_ids)
                    live.generated += len(new)
                    live.started = True
                    finished = bool(out.finished)
                    if finished and (out.kv_transfer_params or {}).get(RELEASE_KEY) is not None:
                        # Released (D->D): the stream ends here without a final delta.
                        if new:
                            yield TokenDelta(token_ids=new, num_prompt_tokens=live.prompt_tokens)
                        _settle(live, handoff(live, out.kv_transfer_params or {}))
                        return
                    yield TokenDelta(
                        token_ids=new,
                        finish_reason=(completion.finish_reason or "stop") if finished else None,
                        stop_reason=completion.stop_reason if finished else None,
                        kv_transfer_params=out.kv_transfer_params if finished else None,
                        num_prompt_tokens=live.prompt_tokens,
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
        """Stop ``request_id`` at the next step boundary with its KV held (DESIGN §5.1).

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
