"""structlog, configured once per process (structlog's production recipe).

JSON lines when stderr is not a TTY (systemd/journald, CI), a readable
console renderer on a TTY. Context is bound per unit of work with
``structlog.contextvars.bound_contextvars(instance=..., request_id=...,
migration_id=...)`` so every line of that unit carries it.

No line shows a secret: every URL password, and every secret value the
process was configured with (``secret_values(settings)``), is masked as
``***`` in each value, in tracebacks and in the stdlib loggers' lines.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
import sys
from collections.abc import Iterable, Iterator, MutableMapping
from typing import Any, TextIO

import structlog

from star.redact import redact_text
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
    settings: LogSettings | None = None,
    stream: TextIO | None = None,
    secrets: Iterable[str] = (),
    **context: Any,
) -> None:
    """Configure structlog (and route stdlib logging through it).

    ``secrets`` (``star.settings.secret_values(settings)``) are masked in every
    line, as URL passwords always are. ``context`` is bound for the life of the
    process, e.g. ``role="scheduler"``. Calling it again reconfigures (tests do
    that); processes call it once.
    """
    hidden = tuple(secrets)
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
            colors=stream.isatty(), exception_formatter=_console_traceback(hidden)
        )

    structlog.configure(
        processors=[*shared, _Redact(hidden), _RedactRendered(renderer, hidden)],
        wrapper_class=structlog.make_filtering_bound_logger(level),
        logger_factory=structlog.PrintLoggerFactory(stream),
        cache_logger_on_first_use=False,
    )
    structlog.contextvars.clear_contextvars()
    if context:
        structlog.contextvars.bind_contextvars(**context)

    # Libraries (redis, vllm) log through the stdlib; keep their warnings visible.
    handler = logging.StreamHandler(stream)
    handler.setFormatter(_RedactingFormatter("%(levelname)s %(name)s: %(message)s", hidden))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(max(level, logging.WARNING))


def _console_traceback(secrets: tuple[str, ...]) -> structlog.typing.ExceptionRenderer:
    """rich's traceback without local variables, or the plain one without rich."""
    if importlib.util.find_spec("rich") is None:
        return structlog.dev.plain_traceback
    return _RedactingRichTraceback(secrets)


class _RedactingRichTraceback:
    """rich's traceback (structlog's settings, no locals) with each exception's
    message and notes masked before rich lays them out: its colours and line
    wrapping split a URL (``?password=`` highlighted as a key and a value), so
    the mask over the rendered line could no longer recognise it."""

    def __init__(self, secrets: tuple[str, ...]) -> None:
        self.secrets = secrets
        self.options = structlog.dev.RichTracebackFormatter(show_locals=False)

    def __call__(self, sio: TextIO, exc_info: structlog.typing.ExcInfo) -> None:
        from rich.console import Console
        from rich.traceback import Traceback

        o = self.options
        trace = Traceback.extract(*exc_info, show_locals=False)
        self._mask(trace.stacks)
        tb = Traceback(
            trace,
            width=o.width,
            extra_lines=o.extra_lines,
            theme=o.theme,
            word_wrap=o.word_wrap,
            indent_guides=o.indent_guides,
            suppress=o.suppress,
            max_frames=o.max_frames,
        )
        if hasattr(tb, "code_width"):  # rich >= 13.8
            tb.code_width = o.code_width
        sio.write("\n")
        Console(file=sio, color_system=o.color_system, width=o.width).print(tb)

    def _mask(self, stacks: Any) -> None:
        for stack in stacks:
            stack.exc_value = redact_text(stack.exc_value, self.secrets)
            stack.notes = [redact_text(note, self.secrets) for note in stack.notes]
            if stack.syntax_error is not None:
                stack.syntax_error.line = redact_text(stack.syntax_error.line, self.secrets)
                stack.syntax_error.msg = redact_text(stack.syntax_error.msg, self.secrets)
            self._mask(stack.exceptions)


class _Redact:
    """Mask secrets in every value of the event (nested ones, the rendered traceback)."""

    def __init__(self, secrets: tuple[str, ...]) -> None:
        self.secrets = secrets

    def __call__(
        self, _logger: Any, _name: str, event: MutableMapping[str, Any]
    ) -> MutableMapping[str, Any]:
        for key, value in event.items():
            if key != "exc_info":  # the console renderer formats it; _RedactRendered masks that
                event[key] = self._walk(value)
        return event

    def _walk(self, value: Any) -> Any:
        if isinstance(value, str):
            return redact_text(value, self.secrets)
        if isinstance(value, dict):
            return {k: self._walk(v) for k, v in value.items()}
        if isinstance(value, list | tuple):
            return [self._walk(v) for v in value]
        if isinstance(value, int | float | bool) or value is None:
            return value
        # An object (an exception, a settings area): its repr, as JSONRenderer would show it.
        return redact_text(repr(value), self.secrets)


class _RedactRendered:
    """The renderer, then a last mask over the line (what the console renderer formatted itself)."""

    def __init__(self, renderer: structlog.typing.Processor, secrets: tuple[str, ...]) -> None:
        self.renderer = renderer
        self.secrets = secrets

    def __call__(self, logger: Any, name: str, event: MutableMapping[str, Any]) -> Any:
        line = self.renderer(logger, name, event)
        return redact_text(line, self.secrets) if isinstance(line, str) else line


class _RedactingFormatter(logging.Formatter):
    """The stdlib lines (redis-py, vLLM) masked like structlog's."""

    def __init__(self, fmt: str, secrets: tuple[str, ...]) -> None:
        super().__init__(fmt)
        self.secrets = secrets

    def format(self, record: logging.LogRecord) -> str:
        return redact_text(super().format(record), self.secrets)
