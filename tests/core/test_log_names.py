"""Log event names are snake_case constants, never f-strings (STYLE: logs)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("star", "workers", "scheduler", "proxy")
LEVELS = {"debug", "info", "warning", "error", "exception", "critical"}
SNAKE = re.compile(r"[a-z][a-z0-9_]*")
# Event names that are not literals here, each a snake_case constant elsewhere:
# Outage's two names (given by its callers), the migration machine's Warn text,
# the proxy's canonical request line (request_finished / _failed / _aborted).
COMPUTED = {
    ("star/bus/connection.py", "self.down_event"),
    ("star/bus/connection.py", "self.up_event"),
    ("proxy/decode_run.py", "action.text"),
    ("proxy/app.py", "'request_' + outcome"),
}


def _name(node: ast.expr) -> str:
    return node.id if isinstance(node, ast.Name) else getattr(node, "attr", "")


def _is_logger_factory(node: ast.expr) -> bool:
    """``structlog.get_logger(...)`` or ``<something>.bind(...)``."""
    return isinstance(node, ast.Call) and _name(node.func) in {"get_logger", "bind"}


def _log_calls(tree: ast.AST) -> list[ast.Call]:
    # Loggers: names ending in "log", and any name bound to a logger factory
    # (``bound = self.log.bind(...)``); ``log.bind(...).info(...)`` counts too.
    bound = {
        _name(target)
        for node in ast.walk(tree)
        if isinstance(node, ast.Assign | ast.AnnAssign) and _is_logger_factory(node.value)  # type: ignore[arg-type]
        for target in (node.targets if isinstance(node, ast.Assign) else [node.target])
    }
    out = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
            continue
        owner = node.func.value
        name = _name(owner)
        is_logger = name.endswith("log") or name in bound or _is_logger_factory(owner)
        if node.func.attr in LEVELS and is_logger and node.args:
            out.append(node)
    return out


def _offenders() -> list[str]:
    bad = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            for call in _log_calls(ast.parse(path.read_text())):
                first = call.args[0]
                if isinstance(first, ast.Constant) and isinstance(first.value, str):
                    if not SNAKE.fullmatch(first.value):
                        bad.append(f"{rel}:{call.lineno} {first.value!r}")
                elif (rel, ast.unparse(first)) not in COMPUTED:
                    bad.append(f"{rel}:{call.lineno} {ast.unparse(first)}")
    return bad


def test_every_log_event_name_is_a_snake_case_constant() -> None:
    assert _offenders() == []


def test_the_check_sees_a_bad_name() -> None:
    tree = ast.parse('log.info(f"{key} unreadable")\nlog.warning("two words")\nlog.info("ok_name")')
    calls = _log_calls(tree)
    assert len(calls) == 3
    assert [SNAKE.fullmatch(c.args[0].value) is not None for c in calls[1:]] == [False, True]  # type: ignore[attr-defined]
    assert isinstance(calls[0].args[0], ast.JoinedStr)


def test_the_check_sees_bound_loggers() -> None:
    tree = ast.parse(
        'bound = self.log.bind(stream=1)\nbound.info("stream failed")\n'
        'log.bind(x=1).warning("two words")\nparser.error("not a log")'
    )
    calls = _log_calls(tree)
    assert [c.args[0].value for c in calls] == ["stream failed", "two words"]  # type: ignore[attr-defined]
