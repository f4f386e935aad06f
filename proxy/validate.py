"""Typed access to a JSON request body with OpenAI-style 400s naming the parameter."""

from __future__ import annotations

import json
import math
import re
from typing import Any, NoReturn

from proxy.http import HttpError

# Nesting of arrays and objects a request body may have (the top-level object
# is 1). A real request nests a few levels (chat content parts, a JSON schema
# for structured outputs: a dozen or two); the bound is checked on the bytes,
# before json's decoder or anything after it (the wire encoder) recurses.
MAX_JSON_DEPTH = 64
_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')
# Brackets become +1 and -1 (as int8); every other byte is dropped.
_STEPS = bytes.maketrans(b"[{]}", b"\x01\x01\xff\xff")
_NOT_BRACKETS = bytes(sorted(set(range(256)) - set(b"[]{}")))


def json_depth_exceeds(body: bytes, limit: int = MAX_JSON_DEPTH) -> bool:
    """Whether ``body`` nests arrays and objects deeper than ``limit`` (no recursion).

    Brackets inside strings do not count. The work is in C: strings cut out,
    brackets turned into +1/-1 steps, the depth their running sum's maximum
    (4 MiB of brackets: ~20 ms). On malformed JSON the answer is a guess, and
    the decoder reports the body as invalid anyway.
    """
    if body.count(b"[") + body.count(b"{") <= limit:
        return False  # the usual body: too few brackets to nest that deep
    import numpy as np  # only for bodies with many brackets

    steps = _JSON_STRING.sub(b"", body).translate(_STEPS, _NOT_BRACKETS)
    if not steps:
        return False
    return int(np.frombuffer(steps, np.int8).cumsum(dtype=np.int32).max()) > limit


def parse_object(body: bytes) -> dict[str, Any]:
    """Decode a JSON object body (NaN and Infinity are not JSON and are refused)."""
    if json_depth_exceeds(body):
        raise HttpError(
            400,
            f"request body nests arrays and objects deeper than {MAX_JSON_DEPTH} levels",
            code="invalid_json",
        )
    try:
        data = json.loads(body, parse_constant=_no_constant)
    except (ValueError, UnicodeDecodeError) as exc:
        raise HttpError(
            400, f"request body is not valid JSON: {exc}", code="invalid_json"
        ) from None
    except RecursionError:  # json's decoder recurses per nesting level
        raise HttpError(400, "request body nests too deeply", code="invalid_json") from None
    if not isinstance(data, dict):
        raise HttpError(400, "request body must be a JSON object", code="invalid_json")
    # An escape such as \ud800 decodes to a lone UTF-16 surrogate, which is no text:
    # the tokenizer and every UTF-8 encoder refuse it. Raw UTF-8 cannot carry one.
    if (b"\\ud" in body or b"\\uD" in body) and _has_lone_surrogate(data):
        raise HttpError(
            400,
            "request body has a string with an unpaired UTF-16 surrogate escape (\\ud800-\\udfff)",
            code="invalid_json",
        )
    return data


def _no_constant(name: str) -> NoReturn:
    raise ValueError(f"{name} is not a valid JSON value")


def _has_lone_surrogate(data: Any) -> bool:
    """Whether a string anywhere in ``data`` (keys too) is not encodable as UTF-8."""
    stack = [data]  # no recursion: the body may nest as deep as json allowed
    while stack:
        value = stack.pop()
        if isinstance(value, dict):
            stack.extend(value.keys())
            stack.extend(value.values())
        elif isinstance(value, list):
            stack.extend(value)
        elif isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                return True
    return False


def _type_name(value: Any) -> str:
    if value is None:
        return "null"
    return {
        bool: "a boolean",
        int: "an integer",
        float: "a number",
        str: "a string",
        list: "an array",
        dict: "an object",
    }.get(type(value), type(value).__name__)


class Fields:
    """Reads parameters out of a decoded body, checking type and range.

    Every error is a 400 whose ``param`` is the parameter's name (or the
    name the client used, see ``param_alias``) and whose message quotes the
    bad value, in the wording of OpenAI's own errors.
    """

    def __init__(self, data: dict[str, Any]) -> None:
        self.data = data
        self.param_alias: dict[str, str] = {}
        # An error for a stream to carry once every other check passed (proxy.http.InStreamError).
        self.in_stream: HttpError | None = None

    def raw(self, name: str) -> Any:
        """The value as sent (None if absent or null)."""
        return self.data.get(name)

    def fail(self, name: str, message: str, code: str = "invalid_value") -> NoReturn:
        """Raise the 400 for parameter ``name``."""
        param = self.param_alias.get(name, name)
        raise HttpError(400, message.replace("{param}", param), param=param, code=code)

    def _wrong_type(self, name: str, expected: str, value: Any) -> NoReturn:
        self.fail(
            name,
            f"Invalid type for '{{param}}': expected {expected}, but got "
            f"{_type_name(value)} instead.",
            "invalid_type",
        )

    def bool_(self, name: str, default: bool) -> bool:
        """A boolean parameter."""
        value = self.data.get(name)
        if value is None:
            return default
        if not isinstance(value, bool):
            self._wrong_type(name, "a boolean", value)
        return value

    def opt_int(self, name: str, lo: int | None = None, hi: int | None = None) -> int | None:
        """An integer parameter in ``[lo, hi]``, or None when absent."""
        value = self.data.get(name)
        if value is None:
            return None
        if isinstance(value, float) and value.is_integer():
            value = int(value)  # some clients send 16.0
        if not isinstance(value, int) or isinstance(value, bool):
            self._wrong_type(name, "an integer", value)
        self._range(name, value, lo, hi)
        return value

    def int_(self, name: str, default: int, lo: int | None = None, hi: int | None = None) -> int:
        """An integer parameter with a default."""
        value = self.opt_int(name, lo, hi)
        return default if value is None else value

    def opt_float(
        self, name: str, lo: float | None = None, hi: float | None = None
    ) -> float | None:
        """A number in ``[lo, hi]``, or None when absent."""
        value = self.data.get(name)
        if value is None:
            return None
        if (
            not isinstance(value, int | float)
            or isinstance(value, bool)
            or not math.isfinite(value)
        ):
            self._wrong_type(name, "a number", value)
        self._range(name, value, lo, hi)
        return float(value)

    def _range(self, name: str, value: float, lo: float | None, hi: float | None) -> None:
        if lo is not None and value < lo:
            self.fail(
                name, f"Invalid '{{param}}': expected a value >= {lo:g}, but got {value!r} instead."
            )
        if hi is not None and value > hi:
            self.fail(
                name, f"Invalid '{{param}}': expected a value <= {hi:g}, but got {value!r} instead."
            )

    def dict_(self, name: str) -> dict[str, Any] | None:
        """An object parameter, or None."""
        value = self.data.get(name)
        if value is not None and not isinstance(value, dict):
            self._wrong_type(name, "an object", value)
        return value

    def str_list(self, name: str, max_items: int, max_chars: int | None = None) -> list[str]:
        """A string or an array of strings (``stop``), each at most ``max_chars`` long."""
        value = self.data.get(name)
        if value is None:
            return []
        if isinstance(value, str):
            value = [value]
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            self._wrong_type(name, "a string or an array of strings", value)
        if len(value) > max_items:
            self.fail(name, f"Invalid '{{param}}': at most {max_items} items, got {len(value)}.")
        if max_chars is not None and (longest := max(map(len, value), default=0)) > max_chars:
            self.fail(
                name,
                f"Invalid '{{param}}': each string at most {max_chars} characters, got {longest}.",
            )
        return list(value)

    def token_ids(self, name: str, vocab: int) -> list[int]:
        """An array of token ids inside the vocabulary."""
        value = self.data.get(name)
        if value is None:
            return []
        if not isinstance(value, list) or not all(
            isinstance(v, int) and not isinstance(v, bool) for v in value
        ):
            self._wrong_type(name, "an array of integers", value)
        bad = next((v for v in value if not 0 <= v < vocab), None)
        if bad is not None:
            self.fail(
                name,
                f"Invalid '{{param}}': token id {bad} is outside the vocabulary (0..{vocab - 1}).",
            )
        return list(value)

    def logit_bias(self, name: str, vocab: int) -> dict[int, float]:
        """``{"token id": bias}`` with bias in [-100, 100], keyed by int."""
        value = self.dict_(name)
        if not value:
            return {}
        out: dict[int, float] = {}
        for key, bias in value.items():
            try:
                tid = int(key)
            except ValueError:
                self.fail(name, f"Invalid '{{param}}': key {key!r} is not a token id.")
            if not 0 <= tid < vocab:
                self.fail(name, f"Invalid '{{param}}': token id {tid} is outside the vocabulary.")
            if (
                not isinstance(bias, int | float)
                or isinstance(bias, bool)
                or not -100 <= bias <= 100
            ):
                self.fail(
                    name, f"Invalid '{{param}}': bias for {key} must be a number in [-100, 100]."
                )
            out[tid] = float(bias)
        return out

    def reject_truthy(self, name: str, message: str) -> None:
        """400 ``unsupported_parameter`` if the parameter is set to anything truthy."""
        if self.data.get(name):
            self.fail(name, message, "unsupported_parameter")

    def reject_present(self, name: str, message: str) -> None:
        """400 ``unsupported_parameter`` if the parameter is present and not null."""
        if self.data.get(name) is not None:
            self.fail(name, message, "unsupported_parameter")
