"""Wire schema: round trips (hypothesis) and strict rejection."""

from __future__ import annotations

import typing

import msgpack
import msgspec
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from star import wire
from star.wire import (
    FRAMES,
    BadEncoding,
    Decision,
    Event,
    EventKind,
    FrameDecoder,
    FrameTooLarge,
    Generate,
    MissingField,
    Report,
    RequestLoad,
    Tokens,
    UnknownField,
    UnknownKind,
    UnknownVersion,
    WrongType,
    decode,
    decode_as,
    encode,
    frame,
)
from tests.fuzz.strategies import message

message_strategy = message


ALL = (*wire.BUS_MESSAGES, *FRAMES)


@pytest.mark.parametrize("cls", ALL, ids=lambda c: c.KIND)
@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_every_message_round_trips(cls: type[wire.Message], data: st.DataObject) -> None:
    msg = data.draw(message_strategy(cls))
    assert decode(encode(msg)) == msg
    assert decode_as(encode(msg), cls) == msg


@pytest.mark.parametrize("cls", ALL, ids=lambda c: c.KIND)
@settings(max_examples=20, deadline=None)
@given(data=st.data())
def test_encode_writes_kind_fields_and_version(
    cls: type[wire.Message], data: st.DataObject
) -> None:
    # The shape star inspect and redis-cli show: the kind, every field, the version.
    msg = data.draw(message_strategy(cls))
    plain = msgpack.unpackb(encode(msg), raw=False)
    fields = [f.name for f in msgspec.structs.fields(cls) if f.name != "v"]
    assert list(plain) == ["k", *fields, "v"]
    assert plain["k"] == cls.KIND and plain["v"] == wire.SCHEMA_VERSION
    assert type(plain["v"]) is int


@settings(max_examples=30, deadline=None)
@given(
    msgs=st.lists(st.one_of(*(message_strategy(c) for c in FRAMES)), max_size=6),
    cut=st.integers(1, 64),
)
def test_frames_survive_arbitrary_chunking(msgs: list[wire.Message], cut: int) -> None:
    blob = b"".join(frame(m) for m in msgs)
    dec = FrameDecoder()
    out: list[wire.Message] = []
    for i in range(0, len(blob), cut):
        dec.feed(blob[i : i + cut])
        out.extend(dec)
    assert out == msgs
    assert dec.buffered == 0


def _decision_map() -> dict[str, typing.Any]:
    return msgpack.unpackb(encode(Decision("d", "r", "a", "b", 1, -2.0, "current", 1.0)))


@pytest.mark.parametrize(
    ("mutate", "error", "message"),
    [
        (lambda m: m.update(v=2), UnknownVersion, "schema version 2"),
        (lambda m: m.pop("v"), MissingField, "'v'"),
        (lambda m: m.update(k="nope"), UnknownKind, "'nope'"),
        (lambda m: m.pop("target"), MissingField, "'target'"),
        (lambda m: m.update(extra=1), UnknownField, "'extra'"),
        (lambda m: m.update(tick="1"), WrongType, "decision.tick: expected an integer"),
        (lambda m: m.update(tick=True), WrongType, "decision.tick"),
        (lambda m: m.update(delta_v="x"), WrongType, "decision.delta_v: expected a number"),
        (lambda m: m.update(request=None), WrongType, "decision.request"),
    ],
)
def test_decoding_is_strict(mutate: typing.Any, error: type[Exception], message: str) -> None:
    m = _decision_map()
    mutate(m)
    with pytest.raises(error, match=message.replace("(", r"\(")):
        decode(msgpack.packb(m))


def test_int_is_accepted_where_a_float_is_declared() -> None:
    m = _decision_map()
    m["delta_v"] = -3
    msg = decode(msgpack.packb(m))
    assert isinstance(msg, Decision) and msg.delta_v == -3.0 and isinstance(msg.delta_v, float)


@pytest.mark.parametrize("raw", [b"", b"\xc1", msgpack.packb([1, 2]), msgpack.packb("x")])
def test_garbage_is_bad_encoding(raw: bytes) -> None:
    with pytest.raises(BadEncoding):
        decode(raw)


def test_nested_values_are_checked() -> None:
    r = Report("i", "decode", 1, 0.0, "a:1", 10, 1, 2, 0.1, 32, [1.0], [RequestLoad("r", 1, 0)])
    m = msgpack.unpackb(encode(r))
    m["requests"][0]["tokens"] = "many"
    with pytest.raises(WrongType, match=r"report.requests\[0\].tokens"):
        decode(msgpack.packb(m))
    m = msgpack.unpackb(encode(Event(EventKind.FINISHED, 1.0, "p")))
    m["event"] = "exploded"
    with pytest.raises(WrongType, match="not a EventKind"):
        decode(msgpack.packb(m))


def _report_map() -> dict[str, typing.Any]:
    loads = [RequestLoad("r", 1, 0), RequestLoad("s", 2, 1, 3.5)]
    r = Report("i", "decode", 1, 0.0, "a:1", 10, 1, 2, 0.1, 32, [1.0, 2.0], loads, ["s"])
    return msgpack.unpackb(encode(r))


@pytest.mark.parametrize(
    ("mutate", "error", "message"),
    [
        (
            lambda m: m["requests"][1].update(extra=1),
            UnknownField,
            "report.requests[1]: unknown field 'extra'",
        ),
        (
            lambda m: m["requests"][1].pop("generated"),
            MissingField,
            "report.requests[1]: missing field 'generated'",
        ),
        (
            lambda m: m["requests"][1].update(predicted_remaining=True),
            WrongType,
            "report.requests[1].predicted_remaining: expected float | None, got bool True",
        ),
        (
            lambda m: m["requests"][0].update(true_remaining=1.5),
            WrongType,
            "report.requests[0].true_remaining: expected int | None, got float 1.5",
        ),
        (
            lambda m: m["requests"].__setitem__(1, [1]),
            WrongType,
            "report.requests[1]: expected a map, got list",
        ),
        (lambda m: m.update(requests={}), WrongType, "report.requests: expected a list, got dict"),
        (
            lambda m: m["trace"].__setitem__(1, "2"),
            WrongType,
            "report.trace[1]: expected a number, got str '2'",
        ),
        (
            lambda m: m["in_flight"].append(3),
            WrongType,
            "report.in_flight[1]: expected str, got int 3",
        ),
        (
            lambda m: m.update(predictor=1),
            WrongType,
            "report.predictor: expected bool | None, got int 1",
        ),
    ],
)
def test_a_bad_report_says_where(mutate: typing.Any, error: type[Exception], message: str) -> None:
    m = _report_map()
    mutate(m)
    with pytest.raises(error) as info:
        decode_as(msgpack.packb(m), Report)
    assert type(info.value) is error and str(info.value) == message


def test_integer_trace_points_decode_as_floats() -> None:
    m = _report_map()
    m["trace"] = [3, 2.5]  # what a worker summing integer token counts may send
    report = decode_as(msgpack.packb(m), Report)
    assert report.trace == [3.0, 2.5] and all(type(x) is float for x in report.trace)


def test_expect_restricts_kind() -> None:
    raw = encode(Decision("d", "r", "a", "b", 1, -2.0, "current", 1.0))
    with pytest.raises(UnknownKind, match="expected report"):
        decode(raw, Report)


def test_frame_decoder_rejects_oversized_frames_and_bad_bodies() -> None:
    dec = FrameDecoder(max_frame=16)
    dec.feed((1000).to_bytes(4, "big"))
    with pytest.raises(FrameTooLarge):
        list(dec)
    dec = FrameDecoder()
    bad = msgpack.packb({"v": 1, "k": "generate", "stream": "x"})
    dec.feed(len(bad).to_bytes(4, "big") + bad + frame(Tokens(1, [5])))
    with pytest.raises(WrongType):
        next(dec)
    assert list(dec) == [Tokens(1, [5])]  # the bad frame was consumed; the next one decodes


def test_bus_messages_are_not_frames() -> None:
    dec = FrameDecoder()
    dec.feed(frame(Decision("d", "r", "a", "b", 1, -2.0, "current", 1.0)))
    with pytest.raises(UnknownKind):
        next(dec)


def test_generate_carries_opaque_kv_params() -> None:
    g = Generate(
        3,
        "cmpl-1",
        [1, 2, 3],
        {"max_tokens": 8, "temperature": 0.0},
        {"remote_block_ids": [1, 2], "x": None},
    )
    assert decode(frame(g)[4:]) == g


def test_report_draining_round_trips_and_defaults_for_older_entries() -> None:
    r = Report("i", "decode", 1, 0.0, "a:1", 10, 1, 2, 0.1, 32, [1.0], [], draining=True)
    assert decode_as(encode(r), Report).draining is True
    older = msgpack.unpackb(encode(r))
    del older["draining"]  # what a worker from before the field published
    back = decode_as(msgpack.packb(older), Report)
    assert back.draining is False
    assert back == msgspec.structs.replace(r, draining=False)


def test_true_remaining_and_predictor_default_for_older_entries() -> None:
    load = RequestLoad("q", 50, 10, 12.5, True, true_remaining=40)
    r = Report("i", "decode", 1, 0.0, "a:1", 10, 1, 2, 0.1, 32, [1.0], [load], predictor=False)
    assert decode_as(encode(r), Report) == r
    older = msgpack.unpackb(encode(r))
    del older["predictor"]  # what a worker from before the fields published
    del older["requests"][0]["true_remaining"]
    back = decode_as(msgpack.packb(older), Report)
    assert back.predictor is None  # not said: neither warned about nor counted
    assert back.requests[0].true_remaining is None  # not known: oracle reads it as unknown


def test_decoded_messages_are_the_constructors_frozen_objects() -> None:
    load = RequestLoad("q", 50, 10, 12.5, False, true_remaining=40)
    r = Report("i", "decode", 3, 1.5, "a:1", 10, 1, 2, 0.1, 32, [1.0, 2.5], [load], ["q"])
    back = decode_as(encode(r), Report)
    assert back == r and type(back) is Report and type(back.requests[0]) is RequestLoad
    assert hash(back.requests[0]) == hash(load) and repr(back) == repr(r)
    with pytest.raises(AttributeError):
        back.requests[0].tokens = 1  # type: ignore[misc]
    # Omitted optional fields get the constructor's defaults.
    plain = msgpack.unpackb(encode(r))
    del plain["requests"][0]["migratable"], plain["requests"][0]["true_remaining"]
    assert decode_as(msgpack.packb(plain), Report).requests[0] == RequestLoad("q", 50, 10, 12.5)


@pytest.mark.parametrize(
    ("mutate", "error", "message"),
    [
        (lambda m: m["requests"][0].update(tokens=-1), WrongType, "report.requests[0].tokens: expected an integer >= 0, got int -1"),
        (lambda m: m["requests"][1].update(true_remaining=-3), WrongType, "report.requests[1].true_remaining: expected an integer >= 0, got int -3"),
        (lambda m: m.update(waiting=-2), WrongType, "report.waiting: expected an integer >= 0, got int -2"),
        (lambda m: m.update(v="1"), UnknownVersion, "schema version '1', this build reads 1"),
        (lambda m: m.update(v=True), WrongType, "report.v: expected an integer, got bool True"),
        (lambda m: m.pop("k"), UnknownKind, "unknown message kind None"),
        (lambda m: m.update({7: 1}), WrongType, "report: a key is not a str: int 7"),
    ],
)  # fmt: skip
def test_bounds_and_header_say_where(
    mutate: typing.Any, error: type[Exception], message: str
) -> None:
    m = _report_map()
    mutate(m)
    with pytest.raises(error) as info:
        decode_as(msgpack.packb(m), Report)
    assert type(info.value) is error and str(info.value) == message


def test_a_float_subclass_is_written_as_a_float() -> None:
    # numpy.float64 (the planner's arrays) is a float subclass: written as a float, as before.
    d = Decision("d", "r", "a", "b", 1, np.float64(-2.5), "current", np.float64(1.0))
    assert msgpack.unpackb(encode(d))["delta_v"] == -2.5
    assert decode(encode(d)) == Decision("d", "r", "a", "b", 1, -2.5, "current", 1.0)
    with pytest.raises(TypeError, match="cannot hold a int64"):
        encode(Decision("d", "r", "a", "b", np.int64(1), -2.5, "current", 1.0))
