"""An engine that cannot start says why in one line naming the setting to change.

The table of known vLLM causes (``workers.startup.CAUSES``) and the capture
of the engine core's own exception; a real worker failing this way is in
``tests/cli/test_up_checks.py``.
"""

from __future__ import annotations

import logging

import pytest

from workers.startup import CORE_LOGGER, Setup, core_failure, explain, root_cause

CPU = Setup(kv_cache_space_gib=0.004, max_model_len=4096, gpu_memory_utilization=0.3, cpu=True)
GPU = Setup(kv_cache_space_gib=1.0, max_model_len=4096, gpu_memory_utilization=0.3, cpu=False)

TOO_LITTLE_KV = (
    "ValueError: To serve at least one request with the model's max seq len (4096), (0.0 GiB "
    "KV cache is needed, which is larger than the available KV cache memory (0.0 GiB). Based "
    "on the available memory, the estimated maximum model length is 3968. Try increasing "
    "`gpu_memory_utilization` (which also controls CPU memory on the CPU backend) or "
    "decreasing `max_model_len` when initializing the engine. See https://docs.vllm.ai/"
)
# pydantic's ValidationError text, as vLLM's ModelConfig raises it.
TOO_LONG = (
    "1 validation error for ModelConfig\n  Value error, User-specified max_model_len (100000) is "
    "greater than the derived max_model_len (max_position_embeddings=4096.0 or "
    "model_max_length=None in model's config.json). To allow overriding this maximum, set the "
    "env var VLLM_ALLOW_LONG_MAX_MODEL_LEN=1. [type=value_error, input_value=ArgsKwargs((), "
    "{'model': ...}), input_type=ArgsKwargs]\n    For further information visit "
    "https://errors.pydantic.dev/2.13/v/value_error"
)


@pytest.mark.parametrize(
    ("cause", "setup", "says"),
    [
        (
            TOO_LITTLE_KV,
            CPU,
            "the KV cache (worker.kv_cache_space_gib=0.004) is too small for one request of "
            "worker.max_model_len=4096 tokens (it fits 3968): raise worker.kv_cache_space_gib "
            "or lower worker.max_model_len",
        ),
        (
            TOO_LITTLE_KV,
            GPU,
            "the KV cache (worker.gpu_memory_utilization=0.3) is too small for one request of "
            "worker.max_model_len=4096 tokens (it fits 3968): raise "
            "worker.gpu_memory_utilization or lower worker.max_model_len",
        ),
        (
            "ValueError: No available memory for the cache blocks. Try increasing",
            CPU,
            "no memory is left for the KV cache (worker.kv_cache_space_gib=0.004): "
            "raise worker.kv_cache_space_gib",
        ),
        (
            root_cause(ValueError(TOO_LONG)),
            CPU,
            "worker.max_model_len=100000 is more than the model allows (4096): "
            "lower worker.max_model_len",
        ),
        ("RuntimeError: something else", CPU, "RuntimeError: something else"),
    ],
)
def test_explain_names_the_setting_to_change(cause: str, setup: Setup, says: str) -> None:
    assert explain(cause, setup) == f"the engine did not start: {says}"


def test_root_cause_is_the_innermost_exception_in_one_line() -> None:
    try:
        try:
            raise ValueError(TOO_LONG)
        except ValueError as inner:
            raise RuntimeError("Engine core initialization failed") from inner
    except RuntimeError as outer:
        line = root_cause(outer)
    assert line.startswith("ValueError: User-specified max_model_len (100000) is greater")
    assert "\n" not in line and "[type=" not in line and "pydantic.dev" not in line


def test_the_engine_cores_failed_start_is_captured() -> None:
    """vLLM logs the engine core's exception before re-raising it (``run_engine_core``)."""
    logger = logging.getLogger(CORE_LOGGER)
    with core_failure() as failure:
        assert failure.cause() is None
        assert "VLLM_LOGGING_CONFIG_PATH" in failure.environ
        logger.error("EngineCore encountered a fatal error.")  # no exception: not a start
        try:
            raise ValueError(TOO_LITTLE_KV.removeprefix("ValueError: "))
        except ValueError:
            logger.exception("EngineCore failed to start.")
        assert failure.cause() == TOO_LITTLE_KV
    assert failure.cause() is None  # its directory is gone with the block


def test_an_operators_own_vllm_logging_config_is_left_alone() -> None:
    with core_failure({"VLLM_LOGGING_CONFIG_PATH": "/etc/mine.json"}) as failure:
        assert failure.environ == {}
