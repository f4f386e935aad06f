"""Fuzzing the wire decoder (bus messages and token-protocol frames) and the stream table.

Whatever bytes arrive, :func:`star.wire.decode` returns a message or raises a
:class:`~star.wire.WireError`; :class:`~star.wire.FrameDecoder` yields frames
or raises a ``WireError`` and, short of :class:`~star.wire.FrameTooLarge`,
stays in step with the frame boundaries; :func:`workers.protocol.next_state`
returns a state or raises :class:`~workers.protocol.IllegalTransition`.
"""

from __future__ import annotations

import struct
from typing import Any

import msgspec
from hypothesis import given
from hypothesis import strategies as st

from star import wire
from star.wire import (
    FRAMES,
    FrameDecoder,
    FrameTooLarge,
    Message,
    UnknownField,
    WireError,
    WrongType,
    decode,
    encode,
)
from tests.fuzz.common import FUZZ, Tally, run_fuzz
from tests.fuzz.strategies import (
    ANY_VALUE,
    FRAME_MAPS,
    VALID_MAPS,
    broken_map,
    message_map,
    plain_map,
)
from workers.protocol import (
    GenerateRequest,
    IllegalTransition,
    StreamEvent,
    StreamState,
    next_state,
)


def _pack(data: Any) -> bytes:
    return msgspec.msgpack.encode(data)


def _decode(raw: bytes) -> str:
    """Decode ``raw``; a message must survive a re-encode unchanged."""
    try:
        msg = decode(raw)
    except WireError as exc:
        return type(exc).__name__
    again = encode(msg)
    assert encode(decode(again)) == again
    return "decoded"


def test_decode_valid_messages_round_trip() -> None:
    tally = Tally("wire.decode valid maps")

    @FUZZ
    @given(VALID_MAPS)
    def check(data: dict[str, Any]) -> None:
        tally.run(lambda: _decode(_pack(data)))
        assert tally.outcomes.get("decoded", 0) == tally.inputs  # every valid map decodes

    run_fuzz(tally, check)


def test_decode_random_bytes() -> None:
    tally = Tally("wire.decode random bytes")

    @FUZZ
    @given(st.binary(max_size=512))
    def check(raw: bytes) -> None:
        tally.run(lambda: _decode(raw))

    run_fuzz(tally, check)


def test_decode_random_msgpack() -> None:
    tally = Tally("wire.decode random msgpack")

    @FUZZ
    @given(ANY_VALUE | st.dictionaries(st.sampled_from(["v", "k", "stream", "id"]), ANY_VALUE))
    def check(data: Any) -> None:
        tally.run(lambda: _decode(_pack(data)))

    run_fuzz(tally, check)


def test_decode_structurally_broken_messages() -> None:
    tally = Tally("wire.decode broken maps")

    @FUZZ
    @given(broken_map())
    def check(data: Any) -> None:
        tally.run(lambda: _decode(_pack(data)))

    run_fuzz(tally, check)


def _nested_broken(report: dict[str, Any], load: dict[str, Any]) -> dict[str, Any]:
    return {**report, "requests": [*report["requests"], load]}


def test_a_refused_message_gets_a_typed_error_that_names_the_field() -> None:
    """A broken message map, at the top or inside a Report's requests, decodes
    (the break left it valid) or raises one of the typed errors, never the
    bare ``WireError``; an error about a field starts with the message kind
    and the path to it; a valid map always decodes."""
    tally = Tally("wire refusals of broken maps")

    def run(data: dict[str, Any], valid: bool) -> str:
        try:
            decode(_pack(data))
        except WireError as exc:
            assert not valid, f"a valid map was refused: {exc}"
            assert type(exc) is not WireError, str(exc)
            kind = data.get("k")
            if isinstance(exc, UnknownField | WrongType) or str(exc).startswith(f"{kind}:"):
                assert isinstance(kind, str) and str(exc).startswith(kind), str(exc)
                return f"{type(exc).__name__} at a field"
            return type(exc).__name__
        return "decoded"

    maps = (
        VALID_MAPS.map(lambda d: (d, True))
        | broken_map().map(lambda d: (d, False))
        | st.builds(
            _nested_broken,
            message_map(wire.Report),
            broken_map(plain_map(wire.RequestLoad)),
        ).map(lambda d: (d, False))
    )

    @FUZZ
    @given(maps)
    def check(case: tuple[dict[str, Any], bool]) -> None:
        tally.run(lambda: run(*case))

    run_fuzz(tally, check)


@st.composite
def mutated_bytes(draw: st.DrawFn) -> bytes:
    raw = bytearray(_pack(draw(VALID_MAPS)))
    for _ in range(draw(st.integers(1, 4))):
        how = draw(st.sampled_from(["flip", "insert", "delete", "truncate"]))
        pos = draw(st.integers(0, max(0, len(raw) - 1)))
        if how == "flip" and raw:
            raw[pos] ^= 1 << draw(st.integers(0, 7))
        elif how == "insert":
            raw[pos:pos] = draw(st.binary(min_size=1, max_size=8))
        elif how == "delete" and raw:
            del raw[pos : pos + draw(st.integers(1, 8))]
        elif how == "truncate":
            del raw[pos:]
    return bytes(raw)


def test_decode_mutated_encodings() -> None:
    tally = Tally("wire.decode mutated bytes")

    @FUZZ
    @given(mutated_bytes())
    def check(raw: bytes) -> None:
        tally.run(lambda: _decode(raw))

    run_fuzz(tally, check)


# -- token-protocol frames ------------------------------------------------------------

_LEN = struct.Struct(">I")


@st.composite
def frame_stream(draw: st.DrawFn) -> tuple[list[bytes], list[bytes]]:
    """Length-prefixed frames (valid, broken, garbage), and the stream cut into chunks."""
    bodies = draw(
        st.lists(
            FRAME_MAPS.map(_pack) | broken_map(FRAME_MAPS).map(_pack) | st.binary(max_size=64),
            max_size=8,
        )
    )
    stream = b"".join(_LEN.pack(len(b)) + b for b in bodies)
    cuts = sorted(draw(st.lists(st.integers(0, len(stream)), max_size=6)))
    chunks = [stream[a:b] for a, b in zip([0, *cuts], [*cuts, len(stream)], strict=True)]
    return bodies, chunks


def _key(outcome: Message | str) -> bytes | str:
    return encode(outcome) if isinstance(outcome, Message) else outcome


def _expected(body: bytes) -> Message | str:
    try:
        return decode(body, FRAMES)
    except WireError as exc:
        return type(exc).__name__


def test_frame_decoder_stays_in_step_whatever_the_frames() -> None:
    """Each frame, however cut into reads, decodes or fails alone; the next one is intact."""
    tally = Tally("FrameDecoder framed streams")

    def run(bodies: list[bytes], chunks: list[bytes]) -> str:
        decoder = FrameDecoder(max_frame=1 << 16)
        got: list[Message | str] = []
        for chunk in chunks:
            decoder.feed(chunk)
            while True:
                try:
                    got.append(next(decoder))
                except StopIteration:
                    break
                except WireError as exc:
                    got.append(type(exc).__name__)
        # Compared as encodings: a float field may hold NaN, which equals nothing.
        assert [_key(m) for m in got] == [_key(_expected(b)) for b in bodies]
        assert decoder.buffered == 0
        for msg in got:
            if isinstance(msg, wire.Generate):
                GenerateRequest.from_frame(msg)  # the worker's first step with a Generate
        if not got:
            return "no frames"
        return "all decoded" if all(isinstance(m, Message) for m in got) else "some rejected"

    @FUZZ
    @given(frame_stream())
    def check(case: tuple[list[bytes], list[bytes]]) -> None:
        tally.run(lambda: run(*case))

    run_fuzz(tally, check)


def test_frame_decoder_random_bytes() -> None:
    """Random bytes: frames, typed errors, FrameTooLarge (then the connection closes), or more data."""
    tally = Tally("FrameDecoder random bytes")

    def run(chunks: list[bytes]) -> str:
        decoder = FrameDecoder(max_frame=4096)
        outcome = "needs more data"
        for chunk in chunks:
            decoder.feed(chunk)
            while True:
                try:
                    next(decoder)
                    outcome = "frame"
                except StopIteration:
                    break
                except FrameTooLarge:
                    return "FrameTooLarge"
                except WireError as exc:
                    outcome = type(exc).__name__
        return outcome

    @FUZZ
    @given(st.lists(st.binary(max_size=256), max_size=6))
    def check(chunks: list[bytes]) -> None:
        tally.run(lambda: run(chunks))

    run_fuzz(tally, check)


def test_stream_table_random_event_sequences() -> None:
    tally = Tally("workers.protocol.next_state sequences")

    def run(events: list[StreamEvent]) -> str:
        state = StreamState.RUNNING
        for event in events:
            try:
                state = next_state(state, event)
            except IllegalTransition:
                return "IllegalTransition"
        return state.value

    @FUZZ
    @given(st.lists(st.sampled_from(list(StreamEvent)), max_size=12))
    def check(events: list[StreamEvent]) -> None:
        tally.run(lambda: run(events))

    run_fuzz(tally, check)
