"""The stream state table and the values crossing the engine interface."""

from __future__ import annotations

import pytest

from star.wire import CONNECTION_STREAM, Error, Generate, Tokens, ends_stream
from workers.protocol import (
    TRANSITIONS,
    BadRequest,
    EngineDead,
    GenerateRequest,
    IllegalTransition,
    StreamEvent,
    StreamState,
    TokenDelta,
    Unsupported,
    error_frame,
    next_state,
)

S, E = StreamState, StreamEvent


@pytest.mark.parametrize(
    ("state", "event", "after"),
    [
        (S.RUNNING, E.FINISH, S.CLOSED),
        (S.RUNNING, E.ABORT, S.ABORTING),
        (S.ABORTING, E.ABORT, S.ABORTING),
        (S.ABORTING, E.FINISH, S.CLOSED),
        (S.RUNNING, E.RELEASE, S.RELEASING),
        (S.RELEASING, E.REFUSE, S.RUNNING),
        (S.RELEASING, E.HANDOFF, S.CLOSED),
        (S.RELEASING, E.ABORT, S.ABORTING),
        (S.RELEASING, E.FINISH, S.CLOSED),
    ],
)
def test_transitions(state: StreamState, event: StreamEvent, after: StreamState) -> None:
    assert next_state(state, event) is after


@pytest.mark.parametrize(
    ("state", "event"),
    [(s, e) for s in StreamState for e in StreamEvent if (s, e) not in TRANSITIONS],
)
def test_illegal_transitions_raise(state: StreamState, event: StreamEvent) -> None:
    with pytest.raises(IllegalTransition, match=event.value):
        next_state(state, event)


def test_closed_is_terminal() -> None:
    assert not [key for key in TRANSITIONS if key[0] is S.CLOSED]


def test_generate_request_from_frame() -> None:
    msg = Generate(
        stream=3,
        request_id="r",
        prompt_token_ids=[1, 2],
        sampling={"max_tokens": 4},
        kv_transfer_params={"do_remote_prefill": True},
    )
    req = GenerateRequest.from_frame(msg)
    assert req == GenerateRequest("r", [1, 2], {"max_tokens": 4}, {"do_remote_prefill": True})


def test_delta_to_frame() -> None:
    delta = TokenDelta(
        [5, 6],
        finish_reason="stop",
        stop_reason=6,
        kv_transfer_params={"x": 1},
        num_prompt_tokens=9,
    )
    assert delta.finished
    assert delta.to_frame(4) == Tokens(
        stream=4,
        token_ids=[5, 6],
        finish_reason="stop",
        stop_reason=6,
        kv_transfer_params={"x": 1},
        num_prompt_tokens=9,
    )
    assert not TokenDelta([1]).finished


@pytest.mark.parametrize(
    ("exc", "code"),
    [
        (BadRequest("no"), "bad_request"),
        (Unsupported("later"), "unsupported"),
        (EngineDead(), "engine_dead"),
    ],
)
def test_error_frame(exc: Exception, code: str) -> None:
    err = error_frame(2, exc)  # type: ignore[arg-type]
    assert (err.stream, err.code) == (2, code)
    assert err.message


@pytest.mark.parametrize(
    ("err", "final"),
    [
        (Error(1, "bad_request", ""), True),
        (Error(1, "engine_error", ""), True),
        (Error(1, "unsupported", ""), False),
        (Error(1, "duplicate_stream", ""), False),
        (Error(1, "unknown_stream", ""), False),
        (Error(CONNECTION_STREAM, "bad_frame", ""), False),
    ],
)
def test_ends_stream(err: Error, final: bool) -> None:
    assert ends_stream(err) is final
