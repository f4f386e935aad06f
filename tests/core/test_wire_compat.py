"""Messages written by an older ``star.wire`` still decode, and what this one
writes an older one reads.

``wire_v1_bytes.json`` holds the bytes ``star.wire.encode`` wrote for each
sample in ``wire_samples.py`` at commit dd8e1b6, before the messages were
msgspec Structs (a worker or proxy from before that commit writes these
bytes; a Redis stream may hold them). It is a record: never regenerate it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import msgpack
import pytest

from star.wire import BUS_MESSAGES, FRAMES, Report, decode, decode_as, encode, frame
from tests.core.wire_samples import NEWER, SAMPLES

RECORDED: dict[str, str] = json.loads((Path(__file__).parent / "wire_v1_bytes.json").read_text())[
    "samples"
]


def _plain(raw: bytes) -> Any:
    """The map as an older decoder sees it (msgpack, keys in any order)."""
    return msgpack.unpackb(raw, raw=False, strict_map_key=False)


def _typed(value: Any) -> Any:
    """``value`` with each scalar paired with its type: 1 and 1.0 differ on the wire."""
    if isinstance(value, dict):
        return {k: _typed(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_typed(v) for v in value]
    return (type(value), value)


def test_every_kind_is_recorded() -> None:
    kinds = {msg.KIND for msg in SAMPLES.values()}
    newer = {msg.KIND for msg in NEWER.values()}
    assert kinds | newer == {cls.KIND for cls in (*BUS_MESSAGES, *FRAMES)}
    assert not kinds & newer
    assert set(RECORDED) == set(SAMPLES)


@pytest.mark.parametrize("name", sorted(NEWER))
def test_newer_kinds_leave_the_recorded_ones_alone(name: str) -> None:
    # A newer variant of a recorded kind is a kind of its own: the recorded
    # kind's map (an older peer's) is unchanged, the variant adds its fields.
    msg = NEWER[name]
    assert decode(encode(msg)) == msg
    base = type(msg).__mro__[1]
    if base.KIND not in {m.KIND for m in SAMPLES.values()}:
        return  # a new kind, not a variant
    older = base(**{f: getattr(msg, f) for f in base.__struct_fields__})
    assert _plain(encode(older))["k"] == base.KIND
    assert set(_plain(encode(msg))) - set(_plain(encode(older))) == set(
        type(msg).__struct_fields__
    ) - set(base.__struct_fields__)


@pytest.mark.parametrize("name", sorted(SAMPLES))
def test_older_bytes_decode_to_the_same_message(name: str) -> None:
    raw = bytes.fromhex(RECORDED[name])
    msg = SAMPLES[name]
    back = decode(raw)
    assert back == msg and type(back) is type(msg)
    assert decode_as(raw, type(msg)) == msg


@pytest.mark.parametrize("name", sorted(SAMPLES))
def test_this_encoding_is_the_older_map(name: str) -> None:
    # Same keys, same values of the same msgpack types: an older decoder, which
    # reads the map whatever the order of its keys, builds the same message.
    raw = encode(SAMPLES[name])
    assert _typed(_plain(raw)) == _typed(_plain(bytes.fromhex(RECORDED[name])))
    assert frame(SAMPLES[name])[4:] == raw


def test_float_fields_keep_the_type_they_were_given() -> None:
    # An int passed for a float field is written as an int (as before); it reads back as a float.
    report = decode_as(bytes.fromhex(RECORDED["report_int_in_float_fields"]), Report)
    assert report.ts == 1764201602 and type(report.ts) is float
    assert report.trace == [3.0, 2.5] and all(type(x) is float for x in report.trace)
    assert type(_plain(encode(SAMPLES["report_int_in_float_fields"]))["ts"]) is int
