"""Hypothesis strategies for STAR's wire messages, built from the schema in star.wire
(its msgspec types and ``Meta`` bounds, read through ``msgspec.inspect``)."""

from __future__ import annotations

import datetime as dt
import math
from typing import Any

import msgspec
import msgspec.inspect as mi
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
    | st.builds(msgspec.msgpack.Ext, st.integers(0, 127), st.binary(max_size=8))
    | st.datetimes(timezones=st.just(dt.UTC))
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


def _bounds(t: Any, low: Any, high: Any) -> tuple[Any, Any]:
    """The closed range of a msgspec int or float type's ``Meta`` bounds within ``low``..``high``."""
    lo = t.ge if t.ge is not None else (t.gt + 1 if t.gt is not None else low)
    hi = t.le if t.le is not None else (t.lt - 1 if t.lt is not None else high)
    return lo, hi


def plain_for(t: Any, *, nan: bool = True) -> st.SearchStrategy[Any]:
    """Plain (msgpack-ready) values valid for the msgspec type ``t`` (``msgspec.inspect``)."""
    if isinstance(t, mi.AnyType):
        return ANY_VALUE
    if isinstance(t, mi.UnionType):
        return st.one_of([plain_for(a, nan=nan) for a in t.types])
    if isinstance(t, mi.NoneType):
        return st.none()
    if isinstance(t, mi.ListType):
        return st.lists(plain_for(t.item_type, nan=nan), max_size=5)
    if isinstance(t, mi.DictType):
        return st.dictionaries(plain_for(t.key_type), plain_for(t.value_type, nan=nan), max_size=4)
    if isinstance(t, mi.EnumType):
        return st.sampled_from([m.value for m in t.cls])
    if isinstance(t, mi.StructType):
        return plain_map(t.cls)
    if isinstance(t, mi.FloatType):  # an int is a valid float
        lo, hi = _bounds(t, None, None)
        ints = st.integers(
            -(2**31) if lo is None else math.ceil(lo), 2**31 if hi is None else math.floor(hi)
        )
        return st.floats(lo, hi, allow_nan=nan and lo is None and hi is None) | ints
    if isinstance(t, mi.IntType):
        return st.integers(*_bounds(t, -(2**63), 2**64 - 1))
    if isinstance(t, mi.StrType):
        return st.text(max_size=30)
    if isinstance(t, mi.BoolType):
        return st.booleans()
    if isinstance(t, mi.BytesType):
        return st.binary(max_size=40)
    raise TypeError(f"no strategy for {t!r}")


def _fields(cls: type[Any]) -> tuple[mi.Field, ...]:
    """The fields of Struct ``cls`` a message map carries besides its header (``v``, ``k``)."""
    info = mi.type_info(cls)
    assert isinstance(info, mi.StructType)
    return tuple(f for f in info.fields if f.name != "v")


def plain_map(cls: type[Any]) -> st.SearchStrategy[dict[str, Any]]:
    """A valid plain map of Struct ``cls``: every required field, some optional ones."""
    required = {f.name: plain_for(f.type) for f in _fields(cls) if f.required}
    optional = {f.name: plain_for(f.type) for f in _fields(cls) if not f.required}
    return st.fixed_dictionaries(required, optional=optional)


def message(cls: type[Any]) -> st.SearchStrategy[Any]:
    """Messages (Structs) of ``cls`` with every field drawn; no NaN, so they compare equal."""
    return st.builds(cls, **{f.name: _value(f.type) for f in _fields(cls)})


def _value(t: Any) -> st.SearchStrategy[Any]:
    if isinstance(t, mi.StructType):
        return message(t.cls)
    if isinstance(t, mi.EnumType):
        return st.sampled_from(list(t.cls))
    if isinstance(t, mi.ListType):
        return st.lists(_value(t.item_type), max_size=5)
    if isinstance(t, mi.UnionType):
        return st.one_of([_value(a) for a in t.types])
    if isinstance(t, mi.FloatType):
        return st.floats(*_bounds(t, None, None), allow_nan=False, allow_infinity=False)
    if isinstance(t, mi.AnyType | mi.DictType):
        return st.dictionaries(st.text(max_size=8), _PLAIN, max_size=4)
    return plain_for(t, nan=False)


# Any values that round-trip as equal Python objects (no NaN, no extension types).
_PLAIN: st.SearchStrategy[Any] = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**62), 2**62)
    | st.floats(allow_nan=False)
    | st.text(max_size=20),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=20), inner, max_size=4)
    ),
    max_leaves=10,
)


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
