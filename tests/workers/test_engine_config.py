"""Building an engine's configuration, without starting one (imports vLLM, no engine)."""

from __future__ import annotations

import warnings
from types import ModuleType

import pytest

from star.settings import WorkerSettings, load_settings
from workers.protocol import BadRequest, GenerateRequest

pytestmark = [
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
]


@pytest.fixture(scope="module")
def eng() -> ModuleType:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # import-time deprecations in torch/vLLM
        import workers.engine_config

    return workers.engine_config


@pytest.mark.parametrize(
    ("items", "expected"),
    [
        ([], {}),
        (["enforce_eager=true"], {"enforce_eager": True}),
        (["--block-size=16", "dtype=float32"], {"block_size": 16, "dtype": "float32"}),
        (
            ['kv_transfer_config={"kv_role": "kv_both"}'],
            {"kv_transfer_config": {"kv_role": "kv_both"}},
        ),
        (["swap_space=0.5"], {"swap_space": 0.5}),
    ],
)
def test_parse_engine_args(eng: ModuleType, items: list[str], expected: dict[str, object]) -> None:
    assert eng.parse_engine_args(items) == expected


@pytest.mark.parametrize("item", ["enforce_eager", "=3", ""])
def test_parse_engine_args_rejects(eng: ModuleType, item: str) -> None:
    with pytest.raises(eng.EngineConfigError, match="KEY=VALUE"):
        eng.parse_engine_args([item])


def test_spec_from_settings(eng: ModuleType) -> None:
    settings = WorkerSettings(
        role="prefill",
        model="/models/m",
        host="10.0.0.5",
        kv_cache_space_gib=2.5,
        engine_args=("enforce_eager=true",),
    )
    spec = eng.EngineSpec.from_settings(settings, nixl_port=7000)
    assert (spec.model, spec.role, spec.nixl_host, spec.nixl_port) == (
        "/models/m",
        "prefill",
        "10.0.0.5",
        7000,
    )
    assert spec.kv_cache_space_gib == 2.5 and spec.engine_args == {"enforce_eager": True}


def test_spec_defaults_to_the_tiny_model(eng: ModuleType) -> None:
    from star.model import tiny_model_path

    assert eng.EngineSpec.from_settings(WorkerSettings()).model == str(tiny_model_path())


@pytest.mark.parametrize(("field", "value"), [("role", "router"), ("device", "tpu"), ("model", "")])
def test_spec_validates(eng: ModuleType, field: str, value: str) -> None:
    kwargs = {"model": "m", field: value}
    with pytest.raises(eng.EngineConfigError, match=field if field != "model" else "empty"):
        eng.EngineSpec(**kwargs)


def test_engine_args_on_cpu(eng: ModuleType) -> None:
    spec = eng.EngineSpec(model="m", kv_cache_space_gib=0.5, engine_args={"enforce_eager": True})
    args = eng.build_engine_args(spec, cpu=True)
    kv = args.kv_transfer_config
    assert (kv.kv_connector, kv.kv_role, kv.kv_buffer_device) == (
        "StarNixlConnector",
        "kv_both",
        "cpu",
    )
    assert kv.kv_connector_module_path == "workers.vllm_ext"
    assert args.scheduler_cls == "workers.vllm_ext.StarScheduler"
    # A decode instance holds a released request's blocks for a D->D target (issue 6).
    assert kv.kv_connector_extra_config == {
        "num_threads": 1,
        "bidirectional_kv_xfer": True,
        "decoder_kv_blocks_ttl": eng.RELEASE_TTL_S,
    }
    prefill = eng.build_engine_args(eng.EngineSpec(model="m", role="prefill"), cpu=True)
    assert prefill.kv_transfer_config.kv_connector_extra_config == {"num_threads": 1}
    assert args.kv_cache_memory_bytes == 512 * 1024 * 1024
    assert args.enable_logging_iteration_details is True
    assert args.enforce_eager is True and args.gpu_memory_utilization == 0.3


def test_cpu_engines_default_to_float32_and_the_user_wins(eng: ModuleType) -> None:
    # vLLM CPU would cast the float32 tiny model to bfloat16 (greedy comparisons drift).
    assert eng.build_engine_args(eng.EngineSpec(model="m"), cpu=True).dtype == "float32"
    user = eng.EngineSpec(model="m", engine_args={"dtype": "bfloat16"})
    assert eng.build_engine_args(user, cpu=True).dtype == "bfloat16"
    assert eng.build_engine_args(eng.EngineSpec(model="m"), cpu=False).dtype == "auto"


def test_a_failed_kv_pull_recomputes(eng: ModuleType) -> None:
    args = eng.build_engine_args(eng.EngineSpec(model="m"), cpu=True)
    assert args.kv_transfer_config.kv_load_failure_policy == "recompute"


def test_engine_args_on_gpu_keep_vllm_defaults(eng: ModuleType) -> None:
    args = eng.build_engine_args(eng.EngineSpec(model="m"), cpu=False)
    from vllm.config import KVTransferConfig

    kv = args.kv_transfer_config
    assert kv.kv_buffer_device == KVTransferConfig().kv_buffer_device  # vLLM's default
    assert kv.kv_connector_extra_config == {
        "bidirectional_kv_xfer": True,
        "decoder_kv_blocks_ttl": eng.RELEASE_TTL_S,
    }
    assert args.kv_cache_memory_bytes is None


def test_engine_args_merge_the_users_kv_config(eng: ModuleType) -> None:
    spec = eng.EngineSpec(
        model="m",
        engine_args={
            "kv_transfer_config": {
                "kv_connector_extra_config": {"bidirectional_kv_xfer": True, "num_threads": 2}
            }
        },
    )
    kv = eng.build_engine_args(spec, cpu=True).kv_transfer_config
    assert kv.kv_connector == "StarNixlConnector"
    assert kv.kv_connector_extra_config == {
        "num_threads": 2,
        "bidirectional_kv_xfer": True,
        "decoder_kv_blocks_ttl": eng.RELEASE_TTL_S,
    }


def test_engine_args_reject_unknown_keys(eng: ModuleType) -> None:
    with pytest.raises(eng.EngineConfigError, match="no_such_flag"):
        eng.build_engine_args(eng.EngineSpec(model="m", engine_args={"no_such_flag": 1}), cpu=True)


@pytest.mark.parametrize(
    ("gib", "cpus", "env", "expected"),
    [
        (1.0, 2, {}, {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_NUM_OF_RESERVED_CPU": "1"}),
        (0.25, 2, {}, {"VLLM_CPU_KVCACHE_SPACE": None, "VLLM_CPU_NUM_OF_RESERVED_CPU": "1"}),
        (2.0, 8, {}, {"VLLM_CPU_KVCACHE_SPACE": "2"}),
        (1.0, 2, {"VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}, {"VLLM_CPU_KVCACHE_SPACE": "1"}),
    ],
)
def test_vllm_environment_on_cpu(
    eng: ModuleType, gib: float, cpus: int, env: dict[str, str], expected: dict[str, str | None]
) -> None:
    spec = eng.EngineSpec(model="m", kv_cache_space_gib=gib, nixl_host="10.1.2.3")
    out = eng.vllm_environment(spec, True, 5601, env, cpus)
    assert out == {
        "VLLM_NIXL_SIDE_CHANNEL_HOST": "10.1.2.3",
        "VLLM_NIXL_SIDE_CHANNEL_PORT": "5601",
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        **expected,
    }


def test_cpu_engines_run_the_model_in_the_engine_core_process(eng: ModuleType) -> None:
    # vLLM's CPU platform turns "uni" into "mp" unless V1 multiprocessing is off.
    spec = eng.EngineSpec(model="m")
    assert eng.build_engine_args(spec, cpu=True).distributed_executor_backend == "uni"
    assert eng.vllm_environment(spec, True, 5601, {}, 2)["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    assert eng.build_engine_args(spec, cpu=False).distributed_executor_backend is None
    mp = eng.EngineSpec(model="m", engine_args={"distributed_executor_backend": "mp"})
    assert eng.build_engine_args(mp, cpu=True).distributed_executor_backend == "mp"
    assert "VLLM_ENABLE_V1_MULTIPROCESSING" not in eng.vllm_environment(mp, True, 5601, {}, 2)


def test_cpu_threads_become_the_engines_openmp_threads_unless_the_operator_set_them(
    eng: ModuleType,
) -> None:
    spec = eng.EngineSpec(model="m", cpu_threads=1)
    assert eng.vllm_environment(spec, True, 5601, {}, 2)["OMP_NUM_THREADS"] == "1"
    assert "OMP_NUM_THREADS" not in eng.vllm_environment(
        spec, True, 5601, {"OMP_NUM_THREADS": "4"}, 2
    )
    assert "OMP_NUM_THREADS" not in eng.vllm_environment(
        eng.EngineSpec(model="m"), True, 5601, {}, 2
    )
    assert "OMP_NUM_THREADS" not in eng.vllm_environment(spec, False, 5601, {}, 2)  # GPU
    settings = load_settings(env={"STAR_WORKER_CPU_THREADS": "3"}).worker
    assert eng.EngineSpec.from_settings(settings).cpu_threads == 3


def test_vllm_environment_on_gpu(eng: ModuleType) -> None:
    out = eng.vllm_environment(eng.EngineSpec(model="m"), False, 5601, {}, 2)
    assert out == {
        "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
        "VLLM_NIXL_SIDE_CHANNEL_PORT": "5601",
    }


def req(sampling: dict[str, object], kv: dict[str, object] | None = None) -> GenerateRequest:
    return GenerateRequest("r", [1, 2, 3], sampling, kv)


def test_sampling_on_decode(eng: ModuleType) -> None:
    from vllm.sampling_params import RequestOutputKind

    params = eng.sampling_params(req({"max_tokens": 7, "temperature": 0.0}), "decode")
    assert params.max_tokens == 7 and params.temperature == 0.0
    assert params.output_kind == RequestOutputKind.DELTA
    assert params.detokenize is False  # the proxy detokenises
    assert params.extra_args is None


def test_sampling_with_stop_strings_detokenises(eng: ModuleType) -> None:
    assert eng.sampling_params(req({"max_tokens": 7, "stop": ["\n"]}), "decode").detokenize


def test_sampling_passes_kv_transfer_params(eng: ModuleType) -> None:
    kv = {"do_remote_prefill": True, "remote_block_ids": [[1]]}
    params = eng.sampling_params(req({"max_tokens": 7}, kv), "decode")
    assert params.extra_args == {"kv_transfer_params": kv}


def test_prompt_logprobs_only_where_the_prompt_is_computed(eng: ModuleType) -> None:
    # The prefill worker computes the prompt, and so does a decode worker
    # prefilling a request itself: both are asked for its logprobs, as flat arrays.
    asked = {"max_tokens": 7, "prompt_logprobs": 2}
    for role in ("prefill", "decode"):
        params = eng.sampling_params(req(asked), role)
        assert params.prompt_logprobs == 2 and params.flat_logprobs
    # A decode worker pulling the prompt's KV, or a continuation, computes none.
    pulled = eng.sampling_params(req(asked, {"do_remote_prefill": True}), "decode")
    assert pulled.prompt_logprobs is None and not pulled.flat_logprobs
    moved = GenerateRequest("r", [1, 2, 3], asked, continued=1, resume=True)
    assert eng.sampling_params(moved, "decode").prompt_logprobs is None
    # Sample logprobs stay where they are.
    both = eng.sampling_params(req({**asked, "logprobs": 1}, {"x": 1}), "decode")
    assert (both.prompt_logprobs, both.logprobs, both.flat_logprobs) == (None, 1, True)


def test_sampling_marks_a_continuation_for_the_tap(eng: ModuleType) -> None:
    # A Generate that continues a request after a handoff says how many tokens
    # it had generated; the tap then fuses its first row without the prompt weight.
    from workers.tap import CONTINUED_KEY

    kv = {"do_remote_decode": True, "remote_block_ids": [[1]]}
    moved = GenerateRequest("r", [1, 2, 3], {"max_tokens": 7}, kv, continued=120)
    assert eng.sampling_params(moved, "decode").extra_args == {
        "kv_transfer_params": kv,
        CONTINUED_KEY: 120,
    }
    recomputed = GenerateRequest("r", [1, 2, 3], {"max_tokens": 7}, continued=2)
    assert eng.sampling_params(recomputed, "decode").extra_args == {CONTINUED_KEY: 2}
    # With the source's predictor state (a Handoff's), the tap continues its fusion.
    from workers.tap import FUSION_KEY

    carried = GenerateRequest("r", [1, 2, 3], {"max_tokens": 7}, continued=2, fusion=[1.5, 9.0])
    assert eng.sampling_params(carried, "decode").extra_args == {
        CONTINUED_KEY: 2,
        FUSION_KEY: [1.5, 9.0],
    }


def test_sampling_on_prefill_keeps_the_kv_for_decode(eng: ModuleType) -> None:
    params = eng.sampling_params(req({"max_tokens": 50, "min_tokens": 10}), "prefill")
    assert (params.max_tokens, params.min_tokens) == (1, 0)
    assert params.extra_args == {"kv_transfer_params": {"do_remote_decode": True}}


def test_sampling_with_logprobs_asks_for_flat_arrays(eng: ModuleType) -> None:
    params = eng.sampling_params(req({"max_tokens": 5, "logprobs": 3}), "decode")
    assert (params.logprobs, params.flat_logprobs) == (3, True)
    assert eng.sampling_params(req({"max_tokens": 5, "logprobs": 0}), "decode").flat_logprobs
    assert not eng.sampling_params(req({"max_tokens": 5}), "decode").flat_logprobs
    # The prefill's one token is not the client's: no logprobs computed for it.
    prefill = eng.sampling_params(req({"max_tokens": 5, "logprobs": 3}), "prefill")
    assert prefill.logprobs is None


def test_sampling_structured_outputs_from_a_map(eng: ModuleType) -> None:
    params = eng.sampling_params(
        req({"max_tokens": 5, "structured_outputs": {"regex": "a+"}}), "decode"
    )
    assert params.structured_outputs.regex == "a+"


def test_engine_extras_reach_the_engine_as_vllms_server_passes_them(eng: ModuleType) -> None:
    """vllm_xargs become extra_args (beside the worker's own keys, which they may not set),
    repetition_detection its params object, thinking_token_budget a field (issue 28)."""
    kv = {"do_remote_prefill": True}
    sampling = {
        "max_tokens": 5,
        "vllm_xargs": {"my_processor": [1, "a"]},
        "repetition_detection": {"max_pattern_size": 4, "min_pattern_size": 2, "min_count": 3},
        "thinking_token_budget": 7,
    }
    params = eng.sampling_params(req(sampling, kv), "decode")
    assert params.extra_args == {"my_processor": [1, "a"], "kv_transfer_params": kv}
    assert (
        params.repetition_detection.max_pattern_size,
        params.repetition_detection.min_count,
    ) == (
        4,
        3,
    )
    assert params.thinking_token_budget == 7
    with pytest.raises(BadRequest, match="kv_transfer_params"):
        eng.sampling_params(
            req({"max_tokens": 5, "vllm_xargs": {"kv_transfer_params": {}}}), "decode"
        )


@pytest.mark.parametrize(
    ("sampling", "match"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"repetition_detection": {"max_pattern_size": 2, "min_count": 1}}, "min_count"),
        ({"bogus": 1}, "bogus"),
        ({"temperature": -1.0}, "temperature"),
        ({"n": 2}, "n must be 1"),
        ({"output_kind": 0}, "output_kind"),
        ({"structured_outputs": {"nope": 1}}, "structured_outputs"),
    ],
)
def test_bad_sampling_is_a_bad_request(
    eng: ModuleType, sampling: dict[str, object], match: str
) -> None:
    with pytest.raises(BadRequest, match=match):
        eng.sampling_params(req(sampling), "decode")


def test_the_served_models_reasoning_parser_reaches_the_engine(eng: ModuleType) -> None:
    # vLLM's --reasoning-parser: the engine's structured outputs start after the reasoning.
    spec = eng.EngineSpec.from_settings(WorkerSettings(), reasoning_parser="deepseek_r1")
    assert eng.build_engine_args(spec, cpu=True).reasoning_parser == "deepseek_r1"
    assert eng.build_engine_args(eng.EngineSpec(model="m"), cpu=True).reasoning_parser == ""
    user = eng.EngineSpec(model="m", reasoning_parser="a", engine_args={"reasoning_parser": "b"})
    assert eng.build_engine_args(user, cpu=True).reasoning_parser == "b"


def test_reasoning_hints_go_to_generate_not_to_sampling_params(eng: ModuleType) -> None:
    hints = {"reasoning_ended": False, "reasoning_parser_kwargs": {"chat_template_kwargs": {}}}
    request = req({"max_tokens": 5, "structured_outputs": {"regex": "a+"}, **hints})
    assert eng.reasoning_hints(request) == hints
    assert eng.sampling_params(request, "decode").structured_outputs.regex == "a+"
    assert eng.sampling_params(request, "prefill").max_tokens == 1
    assert eng.reasoning_hints(req({"max_tokens": 5})) == {}
    assert eng.reasoning_hints(req({"max_tokens": 5, "reasoning_ended": True})) == {
        "reasoning_ended": True
    }


@pytest.mark.parametrize(
    ("sampling", "match"),
    [
        ({"reasoning_ended": 1}, "reasoning_ended must be a boolean"),
        ({"reasoning_ended": "yes"}, "reasoning_ended must be a boolean"),
        ({"reasoning_parser_kwargs": [1]}, "reasoning_parser_kwargs must be an object"),
        ({"reasoning_parser_kwargs": {1: 2}}, "reasoning_parser_kwargs must be an object"),
    ],
)
def test_bad_reasoning_hints_are_a_bad_request(
    eng: ModuleType, sampling: dict[object, object], match: str
) -> None:
    with pytest.raises(BadRequest, match=match):
        eng.reasoning_hints(req({"max_tokens": 5, **sampling}))


def test_nixl_progress_thread_is_paced_and_can_be_unpaced() -> None:
    from nixl import _api

    from workers.vllm_ext import pace_nixl_progress_thread

    original = _api.nixlBind.nixlAgentConfig
    try:
        pace_nixl_progress_thread(700)
        config = _api.nixlBind.nixlAgentConfig()
        config.pthrDelay = 0  # what nixl's agent sets
        assert config.pthrDelay == 700
        config.pthrDelay = 5000
        assert config.pthrDelay == 5000
        pace_nixl_progress_thread(250)  # again: wraps nixl's class, not the paced one
        config = _api.nixlBind.nixlAgentConfig()
        config.pthrDelay = 0
        assert config.pthrDelay == 250
        pace_nixl_progress_thread(0)
        assert _api.nixlBind.nixlAgentConfig is original
    finally:
        _api.nixlBind.nixlAgentConfig = original
