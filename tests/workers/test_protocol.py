"""The stream state table and the values crossing the engine interface."""

from __future__ import annotations

import pytest

from star.wire import (
    CONNECTION_STREAM,
    Error,
    Generate,
    LogprobTokens,
    PromptLogprobs,
    Tokens,
    ends_stream,
)
from workers.protocol import (
    TRANSITIONS,
    BadRequest,
    EngineDead,
    EngineFailed,
    GenerateRequest,
    IllegalTransition,
    StreamEvent,
    StreamState,
    TokenDelta,
    Unsupported,
    delta_logprobs,
    error_frame,
    next_state,
    prompt_scores,
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


def test_logprobs_of_a_delta_from_vllms_flat_arrays() -> None:
    from vllm.logprobs import FlatLogprobs

    # Two positions as vLLM's sampler writes them: the sampled token first, then the
    # top 2 (the sampled one among them at the first, not at the second).
    flat = FlatLogprobs()
    flat.append_fast([7, 7, 3], [-0.5, -0.5, -1.0], iter([1, 1, 2]), [None] * 3)
    flat.append_fast([9, 4, 3], [-4.0, -0.25, -2.0], iter([5, 1, 2]), [None] * 3)
    fields = delta_logprobs(flat, 2)
    assert fields == {
        "logprobs": [-0.5, -4.0],
        "top_ids": [7, 3, 4, 3],
        "top_logprobs": [-0.5, -1.0, -0.25, -2.0],
    }
    frame = TokenDelta([7, 9], "length", **fields).to_frame(5)
    assert isinstance(frame, LogprobTokens) and frame.consistent() and frame.top_k == 2
    assert (frame.stream, frame.token_ids, frame.finish_reason) == (5, [7, 9], "length")
    assert delta_logprobs(None, 2) == {}
    with pytest.raises(EngineFailed, match="1 of 2"):
        delta_logprobs(flat[:1], 2)


def test_logprobs_of_deltas_vllm_merged_keep_k_top_entries_a_position() -> None:
    from vllm.logprobs import FlatLogprobs

    def step(sampled: tuple[int, float, int], top: list[tuple[int, float]]) -> FlatLogprobs:
        # One step as vLLM's sampler writes it: the sampled token, then the top k.
        flat = FlatLogprobs()
        token, value, rank = sampled
        ranks = iter([rank, *range(1, len(top) + 1)])
        ids = [token, *(t for t, _ in top)]
        flat.append_fast(ids, [value, *(v for _, v in top)], ranks, [None] * len(ids))
        return flat

    steps = [
        step((7, -0.5, 1), [(7, -0.5), (3, -1.0)]),  # greedy: the sampled one ranked first
        step((3, -2.0, 2), [(4, -0.25), (3, -2.0)]),  # sampled second
        step((9, -4.0, 5), [(4, -0.25), (3, -2.0)]),  # sampled outside the top 2
    ]
    apart = [delta_logprobs(s, 1, 2) for s in steps]
    # A reader that fell behind: vLLM merges the three deltas (RequestOutput.add).
    merged = step((7, -0.5, 1), [(7, -0.5), (3, -1.0)])
    merged.extend(steps[1])
    merged.extend(steps[2])
    sizes = [e - s for s, e in zip(merged.start_indices, merged.end_indices, strict=True)]
    assert sizes == [3, 2, 3]  # the second's sampled entry merged with its top-2 twin
    fields = delta_logprobs(merged, 3, 2)
    assert fields == {key: [x for a in apart for x in a[key]] for key in fields}
    assert fields["top_ids"] == [7, 3, 4, 3, 4, 3]
    frame = TokenDelta([7, 3, 9], None, **fields).to_frame(1)
    assert isinstance(frame, LogprobTokens) and frame.consistent() and frame.top_k == 2


def test_a_delta_without_logprobs_or_tokens_is_a_plain_tokens_frame() -> None:
    assert type(TokenDelta([7]).to_frame(1)) is Tokens
    # The last delta of a request with logprobs may carry no token: nothing to score.
    assert type(TokenDelta([], "stop", logprobs=[]).to_frame(1)) is Tokens


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # torch.jit, imported by vLLM
def test_prompt_logprobs_from_vllms_flat_arrays() -> None:
    import numpy as np
    import torch
    from vllm.v1.engine.logprobs import LogprobsProcessor
    from vllm.v1.outputs import LogprobsTensors

    # A prompt of 3 tokens scored with k = 2, through vLLM's own processor (flat,
    # as STAR's engines ask): rows 1 and 2 are prompt tokens 1 and 2, each
    # with its rank, then the top 2 (the token among them at the first only).
    proc = LogprobsProcessor(None, None, None, None, None, 2)
    from vllm.logprobs import create_prompt_logprobs

    proc.prompt_logprobs = create_prompt_logprobs(True)
    ids = torch.tensor([[5, 5, 8], [9, 4, 8]])
    values = torch.tensor([[-0.5, -0.5, -1.5], [-6.0, -0.25, -2.0]])
    proc._update_prompt_logprobs(LogprobsTensors(ids, values, torch.tensor([1, 7])))
    scores = prompt_scores(proc.prompt_logprobs, 3)
    assert scores is not None
    assert (scores.logprobs, scores.ranks) == ([-0.5, -6.0], [1, 7])
    assert (scores.top_ids, scores.top_logprobs) == ([5, 8, 4, 8], [-0.5, -1.5, -0.25, -2.0])
    frame = scores.to_frame(4)
    assert isinstance(frame, PromptLogprobs) and frame.consistent(3) and frame.top_k == 2
    assert not frame.consistent(4)
    # The later deltas of a request: vLLM has popped them ([]), or none were asked for.
    assert prompt_scores([], 3) is None and prompt_scores(None, 3) is None
    with pytest.raises(EngineFailed, match="3 positions of 5"):
        prompt_scores(proc.prompt_logprobs, 5)
    # k = 0: the prompt tokens alone.
    proc0 = LogprobsProcessor(None, None, create_prompt_logprobs(True), None, None, 0)
    proc0._update_prompt_logprobs(
        LogprobsTensors(torch.tensor([[3]]), torch.tensor([[-1.0]]), torch.tensor([4]))
    )
    bare = prompt_scores(proc0.prompt_logprobs, 2)
    assert bare is not None and (bare.logprobs, bare.ranks, bare.top_ids) == ([-1.0], [4], [])
    assert np.isfinite(bare.logprobs).all()
