"""What vLLM engine to build for a worker: :class:`EngineSpec`, the engine
arguments and environment it becomes, and a request's sampling parameters.

Pure functions of the settings and the request; :mod:`workers.engine` builds
the engine from them. Both roles use vLLM's ``NixlConnector`` with
``kv_role="kv_both"`` (a decode instance is also a D->D source).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import structlog
from vllm import SamplingParams
from vllm.config import KVTransferConfig, VllmConfig
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.sampling_params import (
    RepetitionDetectionParams,
    RequestOutputKind,
    StructuredOutputsParams,
)
from vllm.utils.torch_utils import get_dtype_size, kv_cache_dtype_str_to_dtype

from star.settings import WorkerSettings
from workers.continuation import RESUME_KEY
from workers.extension import QUALNAME as WORKER_EXTENSION
from workers.nixl_auth import SECRET_ENV as NIXL_SECRET_ENV
from workers.protocol import (
    BadRequest,
    GenerateRequest,
)
from workers.tap import CONTINUED_KEY, FUSION_KEY
from workers.vllm_ext import TRANSFER_ENV

log = structlog.get_logger(__name__)

ROLES = ("prefill", "decode")
GiB = 1 << 30
RELEASE_TTL_S = 30
"""A released request's blocks are freed after this long if no target reads them."""

# Keys of ``Generate.sampling`` the worker owns: the output is streamed as deltas
# of token ids (the proxy detokenises), and the KV handoff is set by role.
_RESERVED_SAMPLING = ("output_kind", "extra_args")
# SamplingParams fields that are objects of their own, sent as maps.
_PARAMS_FROM_MAPS: dict[str, Any] = {
    "structured_outputs": StructuredOutputsParams,
    "repetition_detection": RepetitionDetectionParams,
}
# extra_args keys STAR's own (the connector's, the continuation's, the tap's): a
# client's vllm_xargs may not set them.
_OWN_EXTRA_ARGS = frozenset(
    {"kv_transfer_params", "ec_transfer_params", RESUME_KEY, CONTINUED_KEY, FUSION_KEY}
)
# Keys of ``Generate.sampling`` that are not ``SamplingParams`` fields but
# arguments of the engine's ``generate()`` (vLLM's OpenAI server passes them
# there): see :func:`reasoning_hints`.
REASONING_KEYS = ("reasoning_ended", "reasoning_parser_kwargs")


class EngineConfigError(ValueError):
    """The engine cannot be built as configured; ``str()`` names the bad value."""


@dataclass(frozen=True)
class EngineSpec:
    """Everything needed to build one engine; see :meth:`from_settings`.

    ``engine_args`` are extra ``AsyncEngineArgs`` fields (``enforce_eager``,
    ``dtype``, ``block_size``, ...) and win over the values derived here.
    ``nixl_port`` is NIXL's side-channel port (0 = a free one) and
    ``nixl_host`` the address other instances reach it at; ``nixl_secret``
    (``cluster.secret``) keys that side channel's CURVE. ``device`` is
    ``"auto"`` (vLLM's platform), ``"cpu"`` or ``"cuda"``.
    ``reasoning_parser`` is the served model's (``proxy.reasoning_parser``):
    vLLM's ``--reasoning-parser`` also tells the engine where a request's
    reasoning ends, the point from which a structured-output grammar applies.
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
    nixl_secret: str = field(default="", repr=False)
    transfer_us_per_token: float = 0.0
    true_continuation: bool = True
    reasoning_parser: str = ""

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
            "transfer_us_per_token": settings.device_transfer_us_per_token,
            "true_continuation": settings.true_continuation,
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
    # vLLM's NIXL connector, plus the D->D release (workers/vllm_ext.py, docs/design.md §5).
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
    if spec.reasoning_parser:
        # As vLLM's --reasoning-parser: structured outputs start after the reasoning.
        values["reasoning_parser"] = spec.reasoning_parser
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
    * ``STAR_CLUSTER_SECRET`` when ``spec.nixl_secret`` is set (a secret from a
      config file too): the engine puts that listener under CURVE
      (:mod:`workers.nixl_auth`).
    * ``STAR_DEVICE_TRANSFER_US_PER_TOKEN`` when ``spec.transfer_us_per_token``
      is set: emulated device timing of KV pulls
      (:class:`workers.pacing.PulledKvPacer`).
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
    if spec.nixl_secret:
        out[NIXL_SECRET_ENV] = spec.nixl_secret
    if spec.transfer_us_per_token > 0:
        out[TRANSFER_ENV] = f"{spec.transfer_us_per_token:g}"
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


def reasoning_hints(request: GenerateRequest) -> dict[str, Any]:
    """The ``generate()`` arguments of ``request``'s reasoning (raises :class:`BadRequest`).

    vLLM's OpenAI server resolves them from the chat request and its parser
    (``ChatCompletionRequest.resolve_reasoning_ended``; the template's kwargs
    for the engine's own reasoning parser), and so does STAR's proxy, which
    sends them as sampling keys: ``reasoning_ended`` (True: a structured-output
    grammar applies from the first token; None: the engine reads the prompt)
    and ``reasoning_parser_kwargs``. Only set keys are returned.
    """
    out: dict[str, Any] = {}
    ended = request.sampling.get("reasoning_ended")
    if ended is not None:
        if not isinstance(ended, bool):
            raise BadRequest(f"reasoning_ended must be a boolean, got {ended!r}")
        out["reasoning_ended"] = ended
    kwargs = request.sampling.get("reasoning_parser_kwargs")
    if kwargs is not None:
        if not isinstance(kwargs, Mapping) or not all(isinstance(k, str) for k in kwargs):
            raise BadRequest(f"reasoning_parser_kwargs must be an object, got {kwargs!r}")
        out["reasoning_parser_kwargs"] = dict(kwargs)
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
    kwargs = {k: v for k, v in request.sampling.items() if k not in REASONING_KEYS}
    # vLLM's own bookkeeping fields (``_all_stop_token_ids``) are fields too; set
    # from outside they break its constructor.
    reserved = [k for k in _RESERVED_SAMPLING if k in kwargs] + sorted(
        k for k in kwargs if k.startswith("_")
    )
    if reserved:
        raise BadRequest(f"sampling may not set {', '.join(reserved)}")
    if kwargs.get("n", 1) != 1:
        raise BadRequest("n must be 1 on the token protocol (the proxy fans out choices)")
    xargs = kwargs.pop("vllm_xargs", None) or {}
    taken = sorted(set(xargs) & _OWN_EXTRA_ARGS)
    if taken:
        raise BadRequest(f"vllm_xargs may not set {', '.join(taken)}")
    for name, params_class in _PARAMS_FROM_MAPS.items():  # a map on the wire: its class here
        given = kwargs.get(name)
        if isinstance(given, Mapping):
            try:
                kwargs[name] = params_class(**given)
            except Exception as exc:  # as for SamplingParams below
                raise BadRequest(f"bad {name}: {type(exc).__name__}: {exc}") from None
    kwargs.setdefault("detokenize", bool(kwargs.get("stop")))
    kv = dict(request.kv_transfer_params) if request.kv_transfer_params else {}
    if role == "prefill":
        kwargs["max_tokens"] = 1
        kwargs["min_tokens"] = 0
        kwargs.pop("logprobs", None)  # its one token is not the client's
        kv.setdefault("do_remote_decode", True)
    if role == "decode" and (kv or request.continued > 0):
        # The prompt was computed elsewhere (a prefill worker, whose KV this
        # pulls) or before (a continuation): its logprobs were sent from there.
        kwargs.pop("prompt_logprobs", None)
    if kwargs.get("logprobs") is not None or kwargs.get("prompt_logprobs") is not None:
        # Logprobs as flat arrays (vLLM's FlatLogprobs), which the worker sends
        # on as they are (star.wire.LogprobTokens, PromptLogprobs): no Logprob
        # object per entry.
        kwargs["flat_logprobs"] = True
    extra: dict[str, Any] = dict(xargs)  # custom extensions' arguments (vLLM's vllm_xargs)
    if kv:
        extra["kv_transfer_params"] = kv
    if request.resume and request.continued > 0:
        # A true continuation: these become its output tokens (workers.vllm_ext.StarScheduler).
        extra[RESUME_KEY] = [int(t) for t in request.prompt_token_ids[-request.continued :]]
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
    except Exception as exc:
        # vLLM's constructor is the validator of these values, and a wrong type
        # fails it with whatever it trips on (an assert on stop, an
        # AttributeError, a TypeError): each is the request's fault, not ours.
        raise BadRequest(f"bad sampling parameters: {type(exc).__name__}: {exc}") from None
