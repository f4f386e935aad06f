"""Value rules: a type and a check, declared once and applied everywhere.

A :class:`Rule` converts a value to its type (:func:`coerce`: text from the
environment or a flag is parsed, a TOML or JSON value only checked) and runs its
check, a function that returns an error message or None: a declared numeric
:class:`Bound`, a :func:`one_of` set of words, or a function of its own.
:mod:`star.settings` gives every setting one (``RULES``); the planner's
parameters, the simulator's config and the flags that mirror a setting use the
same objects, so each rule is written once (docs/configuration.md).
"""

from __future__ import annotations

import json
import math
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

Check = Callable[[Any], str | None]


@dataclass(frozen=True, slots=True)
class Bound:
    """A numeric bound declared once, as data: ``gt`` / ``ge`` / ``le``, and finite.

    Called as a check (an error message or None). The planner's parameters, the
    simulator's config and the flags that mirror a setting reach the same objects
    through ``star.settings.RULES``, so a bound is never restated.
    """

    says: str
    gt: float | None = None
    ge: float | None = None
    le: float | None = None

    def __call__(self, value: Any) -> str | None:
        if not math.isfinite(value):
            return f"{self.says} (a finite number)"
        if (
            (self.gt is not None and not value > self.gt)
            or (self.ge is not None and not value >= self.ge)
            or (self.le is not None and not value <= self.le)
        ):
            return self.says
        return None


positive = Bound("must be > 0", gt=0)
non_negative = Bound("must be >= 0", ge=0)
fraction = Bound("must be in (0, 1]", gt=0, le=1)
port = Bound("must be a TCP port in 0..65535 (0 = pick a free one)", ge=0, le=65535)


def one_of(*choices: str) -> Check:
    def check(value: Any) -> str | None:
        return None if value in choices else f"must be one of {', '.join(choices)}"

    return check


def _parse_bool(text: str) -> bool:
    low = text.strip().lower()
    if low in {"1", "true", "yes", "on"}:
        return True
    if low in {"0", "false", "no", "off"}:
        return False
    raise ValueError("expected true/false")


_NOUNS: dict[Any, str] = {int: "an integer", float: "a number", str: "a string"}


def coerce(tp: Any, value: Any, from_text: bool) -> Any:
    """Convert ``value`` to ``tp``; strings from env/flags are parsed, TOML values checked."""
    origin = typing.get_origin(tp)
    if origin is tuple:
        (item_tp, _) = typing.get_args(tp)
        if from_text and isinstance(value, str):
            text = value.strip()
            if text.startswith("["):
                value = json.loads(text)
            else:
                value = [part.strip() for part in text.split(",") if part.strip()]
        if not isinstance(value, list | tuple):
            raise ValueError("expected a list")
        return tuple(coerce(item_tp, item, from_text) for item in value)
    if origin in {types.UnionType, typing.Union}:
        # A type or words: int | Literal["auto"].
        args = typing.get_args(tp)
        words = [w for a in args if typing.get_origin(a) is Literal for w in typing.get_args(a)]
        rest = [a for a in args if typing.get_origin(a) is not Literal]
        if not words or len(rest) != 1:
            raise TypeError(f"unsupported settings type {tp}")
        if isinstance(value, str) and value.strip() in words:
            return value.strip()
        try:
            return coerce(rest[0], value, from_text)
        except ValueError:
            quoted = " or ".join(json.dumps(w) for w in words)
            raise ValueError(f"expected {quoted} or {_NOUNS.get(rest[0], rest[0])}") from None
    if origin is Literal:  # its words are the rule's check (Rule.check)
        return coerce(str, value, from_text)
    if tp is bool:
        if isinstance(value, bool):
            return value
        if from_text and isinstance(value, str):
            return _parse_bool(value)
        raise ValueError("expected true or false")
    if tp is int:
        if isinstance(value, bool):
            raise ValueError("expected an integer")
        if isinstance(value, int):
            return value
        if from_text and isinstance(value, str):
            try:
                return int(value.strip().replace("_", ""))
            except ValueError:
                pass
        raise ValueError("expected an integer")
    if tp is float:
        if isinstance(value, bool):
            raise ValueError("expected a number")
        if isinstance(value, int | float):
            return float(value)
        if from_text and isinstance(value, str):
            try:
                return float(value.strip())
            except ValueError:
                pass
        raise ValueError("expected a number")
    if tp is str:
        if isinstance(value, str):
            return value
        raise ValueError("expected a string")
    raise TypeError(f"unsupported settings type {tp}")


@dataclass(frozen=True, slots=True)
class Rule:
    """The rule of one value: the type :func:`coerce` converts to, and its check.

    The one place a value is judged: ``star.settings.load_settings`` (file,
    environment, ``--set``), the planner's parameters (``star.planner.types.PARAM_RULES``),
    the simulator's config (``star.sim.config``) and the flags that
    ``star.settings.add_setting_flag`` makes all call :meth:`parse` or
    :meth:`problem` of the same ``star.settings.RULES`` entry.
    """

    key: str
    tp: Any
    check: Check | None = None
    default: Any = None
    help: str = ""

    def convert(self, raw: Any, *, from_text: bool = True) -> Any:
        """``raw`` as this rule's type (text parsed when ``from_text``); ValueError if it is not one."""
        try:
            return coerce(self.tp, raw, from_text)
        except json.JSONDecodeError as exc:
            raise ValueError(str(exc)) from None

    def parse(self, raw: Any, *, from_text: bool = True) -> Any:
        """``raw`` converted and checked; ValueError saying why it is refused."""
        value = self.convert(raw, from_text=from_text)
        problem = None if self.check is None or value is None else self.check(value)
        if problem:
            raise ValueError(problem)
        return value

    def problem(self, value: Any) -> str | None:
        """Why ``value``, a typed value (never parsed from text), breaks the rule; None if it does not."""
        try:
            self.parse(value, from_text=False)
        except ValueError as exc:
            return str(exc)
        return None
