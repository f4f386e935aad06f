"""Why an engine did not start, in one line that names the setting to change.

vLLM builds the engine core in a child process: what stops it there (too
little KV cache for one request, say) reaches the worker only as "Engine core
initialization failed. See root cause above." vLLM logs the child's exception
on ``vllm.v1.engine.core`` before re-raising it; :func:`core_failure` hangs a
handler there, in the logging configuration the child loads, that writes the
cause to a file the worker reads back. :func:`explain` maps
the known causes to the STAR setting to change (a table, no IO); anything
else is reported by its own last line.
"""

from __future__ import annotations

import contextlib
import copy
import json
import logging
import os
import re
import tempfile
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

CORE_LOGGER = "vllm.v1.engine.core"
_CORE_FAILED = "EngineCore failed to start"


class EngineStartError(RuntimeError):
    """The engine did not start; ``str()`` is the cause in one line."""


def root_cause(exc: BaseException) -> str:
    """``Type: message`` of the innermost cause of ``exc``, its most telling line only.

    pydantic's validation errors (vLLM's config checks) spread one message
    over several lines with a bracketed input dump and a link; the line that
    says what is wrong is kept, without them.
    """
    while exc.__cause__ is not None:
        exc = exc.__cause__
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    lines = [line for line in lines if not line.startswith("For further information")]
    text = lines[-1] if lines else ""
    text = re.sub(r"^Value error, ", "", text)
    text = re.sub(r" \[type=[^\]]*(\]|$).*", "", text)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


@dataclass(frozen=True)
class Setup:
    """The values of the settings a cause is explained in terms of."""

    kv_cache_space_gib: float
    max_model_len: int
    gpu_memory_utilization: float
    cpu: bool

    @property
    def kv_setting(self) -> str:
        """The setting that sizes the KV cache on this device, and its value."""
        if self.cpu:
            return f"worker.kv_cache_space_gib={self.kv_cache_space_gib:g}"
        return f"worker.gpu_memory_utilization={self.gpu_memory_utilization:g}"


def _too_little_kv(m: re.Match[str], s: Setup) -> str:
    fits = f" (it fits {m['fits']})" if m["fits"] else ""
    return (
        f"the KV cache ({s.kv_setting}) is too small for one request of "
        f"worker.max_model_len={m['len']} tokens{fits}: raise {s.kv_setting.split('=')[0]} "
        "or lower worker.max_model_len"
    )


def _no_kv(m: re.Match[str], s: Setup) -> str:
    return (
        f"no memory is left for the KV cache ({s.kv_setting}): raise {s.kv_setting.split('=')[0]}"
    )


def _too_long(m: re.Match[str], s: Setup) -> str:
    return (
        f"worker.max_model_len={m['len']} is more than the model allows ({m['max']}): "
        "lower worker.max_model_len"
    )


# vLLM's message (vllm/v1/core/kv_cache_utils.py, vllm/config/model.py) -> the line to print.
CAUSES: tuple[tuple[re.Pattern[str], Callable[[re.Match[str], Setup], str]], ...] = (
    (
        re.compile(
            r"To serve at least one request with the model's max seq len \((?P<len>\d+)\)"
            r"(?:.*?estimated maximum model length is (?P<fits>\d+))?"
        ),
        _too_little_kv,
    ),
    (re.compile(r"No available memory for the cache blocks"), _no_kv),
    (
        re.compile(
            r"max_model_len \((?P<len>\d+)\) is greater than the derived max_model_len"
            r" \(max_position_embeddings=(?P<max>\d+)"
        ),
        _too_long,
    ),
)


def explain(cause: str, setup: Setup) -> str:
    """The one line an operator reads for ``cause`` (see :data:`CAUSES`)."""
    for pattern, say in CAUSES:
        match = pattern.search(cause)
        if match:
            return f"the engine did not start: {say(match, setup)}"
    return f"the engine did not start: {cause}"


class CoreFailureHandler(logging.Handler):
    """Writes the root cause of the engine core's failed start to ``path``.

    Named in the logging configuration the engine core process loads
    (:func:`core_failure`): keep this module's imports to the standard
    library, it is imported while ``vllm.logger`` is.
    """

    def __init__(self, path: str, level: int | str = logging.ERROR) -> None:
        super().__init__(level)
        self.path = Path(path)

    def emit(self, record: logging.LogRecord) -> None:
        exc = record.exc_info[1] if record.exc_info else None
        if exc is None or not str(record.msg).startswith(_CORE_FAILED):
            return
        with contextlib.suppress(OSError), self.path.open("a") as out:
            out.write(root_cause(exc) + "\n")


@dataclass
class CoreFailure:
    """What the engine core said when it failed to start (see :func:`core_failure`)."""

    path: Path
    environ: dict[str, str]
    """Set while the engine starts: the engine core's logging configuration."""

    def cause(self) -> str | None:
        """Its first root cause line, if it wrote one."""
        try:
            lines = self.path.read_text().splitlines()
        except OSError:
            return None
        return lines[0] if lines else None


def logging_config(cause: Path) -> dict[str, Any]:
    """vLLM's own logging configuration plus a :class:`CoreFailureHandler` writing to ``cause``.

    And a :class:`workers.parent.ParentWatch`: the engine core ends once this
    process is gone.
    """
    from vllm import envs
    from vllm.logger import DEFAULT_LOGGING_CONFIG

    config = copy.deepcopy(DEFAULT_LOGGING_CONFIG)
    # What vllm.logger refreshes from the environment when it applies its default.
    config["handlers"]["vllm"].update(
        level=envs.VLLM_LOGGING_LEVEL, stream=envs.VLLM_LOGGING_STREAM
    )
    for formatter in config["formatters"].values():
        formatter["log_level"] = envs.VLLM_LOGGING_LEVEL
    config["loggers"]["vllm"]["level"] = envs.VLLM_LOGGING_LEVEL
    config["handlers"]["star_start"] = {
        "()": f"{__name__}.{CoreFailureHandler.__qualname__}",
        "path": str(cause),
    }
    config["loggers"][CORE_LOGGER] = {"handlers": ["star_start"], "propagate": True}
    # Attached to no logger: its construction starts the engine core's watch
    # on this process, from the engine core's first moment (workers.parent).
    config["handlers"]["star_parent"] = {
        "()": "workers.parent.ParentWatch",
        "parent": os.getpid(),
    }
    return config


@contextlib.contextmanager
def core_failure(env: Mapping[str, str] | None = None) -> Iterator[CoreFailure]:
    """Within the block, an engine core started from here reports a failed start.

    vLLM spawns the engine core on CPU (and once CUDA is initialised): the
    child loads the logging configuration named by ``VLLM_LOGGING_CONFIG_PATH``
    in :attr:`CoreFailure.environ`, which the caller sets for the start. A
    forked child inherits the handler put on this process's logger instead.
    Where the operator configures vLLM's logging, nothing is added, and
    :meth:`CoreFailure.cause` stays None: the caller falls back to its own
    exception's last line.
    """
    env = os.environ if env is None else env
    with tempfile.TemporaryDirectory(prefix="star-engine-start-") as tmp:
        cause, config = Path(tmp) / "cause", Path(tmp) / "logging.json"
        environ: dict[str, str] = {}
        if env.get("VLLM_CONFIGURE_LOGGING", "1") != "0" and not env.get(
            "VLLM_LOGGING_CONFIG_PATH"
        ):
            config.write_text(json.dumps(logging_config(cause)))
            environ["VLLM_LOGGING_CONFIG_PATH"] = str(config)
        handler = CoreFailureHandler(str(cause))
        logger = logging.getLogger(CORE_LOGGER)
        logger.addHandler(handler)
        try:
            yield CoreFailure(cause, environ)
        finally:
            logger.removeHandler(handler)
