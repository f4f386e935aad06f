"""structlog, configured once per process (structlog's production recipe).

JSON lines when stderr is not a TTY (systemd/journald, CI), a readable
console renderer on a TTY. Context is bound per unit of work with
``structlog.contextvars.bound_contextvars(instance=..., request_id=...,
migration_id=...)`` so every line of that unit carries it.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
import sys
from collections.abc import Iterator
from typing import Any, TextIO

import structlog

from star.settings import LogSettings

_LEVELS = {
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warning": logging.WARNING,
    "error": logging.ERROR,
}


@contextlib.contextmanager
def stdout_to_stderr() -> Iterator[None]:
    """Within the block, whatever is written to file descriptor 1 goes to 2.

    vLLM, NIXL and an unconfigured structlog log to stdout, each through a
    handler that captured the stream (or the file descriptor, in C++) when it
    was set up; a command whose stdout is its result (``star bench predictor
    --engine --json | jq``) runs an engine inside this block, and child
    processes started in it inherit the redirection.
    """
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


def configure_logging(
    settings: LogSettings | None = None, stream: TextIO | None = None, **context: Any
) -> None:
    """Configure structlog (and route stdlib logging through it).

    ``context`` is bound for the life of the process, e.g. ``role="scheduler"``.
    Calling it again reconfigures (tests do that); processes call it once.
    """
    settings = settings or LogSettings()
    stream = stream or sys.stderr
    level = _LEVELS[settings.level]
    as_json = settings.format == "json" or (settings.format == "auto" and not stream.isatty())

    shared: list[structlog.typing.Processor] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        structlog.processors.StackInfoRenderer(),
    ]
    # Tracebacks never carry local variables: structlog's default renders them
    # all (a JSON line of kilobytes per frame, secrets such as a Redis URL's
    # password included).
    renderer: structlog.typing.Processor
    if as_json:
        shared.append(
            structlog.processors.ExceptionRenderer(
                structlog.tracebacks.ExceptionDictTransformer(show_locals=False)
            )
        )
        renderer = structlog.processors.JSONRenderer()
    else:
        renderer = structlog.dev.ConsoleRenderer(
            colors=stream.isatty(), exception_formatter=_console_traceback()
        )

    structlog.configure(
        processors=[*shared, renderer],
        wrapper_class=structlog.make_filtering_bound_logger(level),
        logger_factory=structlog.PrintLoggerFactory(stream),
        cache_logger_on_first_use=False,
    )
    structlog.contextvars.clear_contextvars()
    if context:
        structlog.contextvars.bind_contextvars(**context)

    # Libraries (redis, vllm) log through the stdlib; keep their warnings visible.
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(max(level, logging.WARNING))


def _console_traceback() -> structlog.typing.ExceptionRenderer:
    """rich's traceback without local variables, or the plain one without rich."""
    if importlib.util.find_spec("rich") is None:
        return structlog.dev.plain_traceback
    return structlog.dev.RichTracebackFormatter(show_locals=False)
