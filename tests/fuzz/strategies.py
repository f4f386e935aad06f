"""Hypothesis strategies for STAR's wire messages, built from the schema in star.wire."""

from __future__ import annotations

import dataclasses
import enum
import types
import typing
from typing import Any

import msgpack
from hypothesis import strategies as st

from star import wire
from star.wire import SCHEMA_VERSION, Message

# What msgpack can carry (what a peer could send): nested maps and arrays of scalars.
_SCALARS = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**64 - 1)
    | st.floats()
    | st.text(max_size=20)
    | st.binary(max_size=20)
    # msgpack extension types: an application one, and the timestamp (code -1).
    | st.builds(msgpack.ExtType, st.integers(0, 127), st.binary(max_size=8))
    | st.builds(msgpack.Timestamp, st.integers(0, 2**34 - 1), st.integers(0, 999_999_999))
)
ANY_VALUE: st.SearchStrategy[Any] = st.recursive(
    _SCALARS,
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.dictionaries(st.text(max_size=8) | st.integers(-5, 5), inner, max_size=4)
    ),
    max_leaves=12,
)

ALL_KINDS: tuple[type[Message], ...] = (*wire.BUS_MESSAGES, *wire.FRAMES)


def plain_for(tp: Any) -> st.SearchStrategy[Any]:
    """Plain (msgpack-ready) values that are valid for the schema type ``tp``."""
    if tp is Any:
        return ANY_VALUE
    origin = typing.get_origin(tp)
    if origin in {types.UnionType, typing.Union}:
        return st.one_of([plain_for(a) for a in typing.get_args(tp)])
    if tp is type(None):
        return st.none()
    if origin is list:
        (item,) = typing.get_args(tp)
        return st.lists(plain_for(item), max_size=5)
    if origin is dict:
        key, value = typing.get_args(tp)
        return st.dictionaries(plain_for(key), plain_for(value), max_size=4)
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return st.sampled_from([m.value for m in tp])
    if dataclasses.is_dataclass(tp):
        return plain_map(tp)  # type: ignore[arg-type]
    if tp is float:
        return st.floats(allow_nan=False) | st.integers(-(2**31), 2**31)
    if tp is int:
        return st.integers(min_value=-(2**63), max_value=2**64 - 1)
    if tp is str:
        return st.text(max_size=30)
    if tp is bool:
        return st.booleans()
    if tp is bytes:
        return st.binary(max_size=40)
    raise TypeError(f"no strategy for {tp!r}")


def plain_map(cls: type[Any]) -> st.SearchStrategy[dict[str, Any]]:
    """A valid plain map of dataclass ``cls``: every required field, some optional ones."""
    hints = typing.get_type_hints(cls)
    required: dict[str, st.SearchStrategy[Any]] = {}
    optional: dict[str, st.SearchStrategy[Any]] = {}
    for f in dataclasses.fields(cls):
        has_default = (
            f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING
        )
        (optional if has_default else required)[f.name] = plain_for(hints[f.name])
    return st.fixed_dictionaries(required, optional=optional)


def message_map(cls: type[Message]) -> st.SearchStrategy[dict[str, Any]]:
    """A valid top-level map of message ``cls``, with its version and kind."""
    return plain_map(cls).map(lambda body: {**body, "v": SCHEMA_VERSION, "k": cls.KIND})


VALID_MAPS: st.SearchStrategy[dict[str, Any]] = st.one_of([message_map(c) for c in ALL_KINDS])
FRAME_MAPS: st.SearchStrategy[dict[str, Any]] = st.one_of([message_map(c) for c in wire.FRAMES])


@st.composite
def broken_map(draw: st.DrawFn, maps: st.SearchStrategy[dict[str, Any]] = VALID_MAPS) -> Any:
    """A valid map with one or more structural mistakes (what a buggy or hostile peer sends)."""
    data = dict(draw(maps))
    for _ in range(draw(st.integers(1, 3))):
        how = draw(st.sampled_from(["drop", "add", "retype", "version", "kind", "nest"]))
        keys = sorted(data, key=str)
        if how == "drop" and keys:
            del data[draw(st.sampled_from(keys))]
        elif how == "add":
            data[draw(st.text(max_size=8) | st.integers(-(2**63), 2**64 - 1))] = draw(ANY_VALUE)
        elif how == "retype" and keys:
            data[draw(st.sampled_from(keys))] = draw(ANY_VALUE)
        elif how == "version":
            data["v"] = draw(ANY_VALUE)
        elif how == "kind":
            data["k"] = draw(ANY_VALUE | st.sampled_from([c.KIND for c in ALL_KINDS]))
        elif how == "nest" and keys:
            key = draw(st.sampled_from(keys))
            data[key] = draw(st.sampled_from([[data[key]], {"x": data[key]}, [dict(data)]]))
    return data
