"""structlog configuration: JSON off a TTY, bound context on every line."""

from __future__ import annotations

import io
import json

import structlog

from star.logs import configure_logging
from star.settings import LogSettings


def test_json_lines_with_bound_context() -> None:
    out = io.StringIO()
    configure_logging(LogSettings(), stream=out, role="scheduler")
    log = structlog.get_logger("t")
    with structlog.contextvars.bound_contextvars(request_id="cmpl-1", migration_id="m-7"):
        log.info("moved", instance="decode-1")
    log.debug("hidden at info level")
    lines = [json.loads(line) for line in out.getvalue().splitlines()]
    assert len(lines) == 1
    assert lines[0]["event"] == "moved"
    assert lines[0]["role"] == "scheduler"
    assert lines[0]["request_id"] == "cmpl-1" and lines[0]["migration_id"] == "m-7"
    assert lines[0]["level"] == "info" and "timestamp" in lines[0]


def test_console_format_when_asked() -> None:
    out = io.StringIO()
    configure_logging(LogSettings(format="console", level="debug"), stream=out)
    structlog.get_logger("t").debug("hello", x=1)
    text = out.getvalue()
    assert "hello" in text and "x=1" in text and not text.startswith("{")


def _fail(password: str) -> None:
    raise ValueError("no Redis")


def test_tracebacks_carry_no_local_variables() -> None:
    """structlog's default renders every frame's locals: kilobytes a line, secrets included."""
    secret = "".join(reversed("2retnuh"))  # not in the source lines a traceback quotes
    for fmt in ("json", "console"):
        out = io.StringIO()
        configure_logging(LogSettings(format=fmt, level="debug"), stream=out)
        try:
            _fail(secret)
        except ValueError as exc:
            structlog.get_logger("t").error("failed", exc_info=exc)
        text = out.getvalue()
        assert "no Redis" in text and "_fail" in text  # the traceback is there
        assert secret not in text and "locals" not in text
