"""Logprobs: parameters, formatting tables, and the same output as vLLM's server code.

The tables pin the shapes vLLM 0.32's OpenAI server writes (read from
``vllm/entrypoints/openai/{completion,chat_completion}/serving.py`` and
``vllm/v1/engine/logprobs.py``); the last test renders random sequences both
here and with vLLM's own functions (its ``LogprobsProcessor`` naming tokens
with the model's Hugging Face tokenizer, its servers' ``_create_*_logprobs``)
and requires equal objects.
"""

from __future__ import annotations

import functools
import json
import math
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from proxy.backend import TokenBatch
from proxy.http import HttpError
from proxy.logprobs import ChoiceLogprobs, TokenNames
from proxy.openai import ParsedRequest, Relay, parse_chat, parse_completion
from proxy.tokenizer import ModelCard
from star.model import tiny_model_path
from tests.proxy.vllm_logprobs import Render, vllm_renderer

MODEL = "tiny"


@functools.cache
def _tiny() -> ModelCard:
    return ModelCard.load(tiny_model_path(), MODEL)


@pytest.fixture(scope="module")
def tiny() -> ModelCard:
    """The shipped tiny model's card: a byte-level BPE whose é and 你 take several tokens."""
    return _tiny()


def completion(card: ModelCard, **kw: Any) -> ParsedRequest:
    body = {"model": MODEL, "prompt": kw.pop("prompt", "hello"), **kw}
    return parse_completion(json.dumps(body).encode(), {MODEL: card})


def chat(card: ModelCard, **kw: Any) -> ParsedRequest:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **kw}
    return parse_chat(json.dumps(body).encode(), {MODEL: card})


# -- parameters ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fields", "engine_k", "shown"),
    [
        ({"logprobs": 0}, 0, 0),
        ({"logprobs": 5}, 5, 5),
        ({"logprobs": 20}, 20, 20),
        ({"logprobs": None}, None, None),
        ({}, None, None),
    ],
)
def test_completion_logprobs_reach_the_engine(
    card: ModelCard, fields: dict[str, Any], engine_k: int | None, shown: int | None
) -> None:
    parsed = completion(card, **fields)
    assert parsed.gen.sampling.get("logprobs") == engine_k
    assert parsed.text.logprobs == shown
    # Migratable: a true continuation's new logprobs are the target's (issue 28).
    assert parsed.gen.migratable is True


@pytest.mark.parametrize(
    ("fields", "engine_k"),
    [
        ({"logprobs": True}, 0),
        ({"logprobs": True, "top_logprobs": 3}, 3),
        ({"logprobs": True, "top_logprobs": None}, 0),
        ({"logprobs": False}, None),
        ({"logprobs": False, "top_logprobs": 0}, None),
        ({"top_logprobs": 0}, None),
    ],
)
def test_chat_logprobs_reach_the_engine(
    card: ModelCard, fields: dict[str, Any], engine_k: int | None
) -> None:
    parsed = chat(card, **fields)
    assert parsed.gen.sampling.get("logprobs") == engine_k
    assert parsed.text.logprobs == engine_k
    assert parsed.gen.migratable is True


@pytest.mark.parametrize(
    ("fields", "param", "code", "words"),
    [
        ({"logprobs": "yes"}, "logprobs", "invalid_type", "boolean"),
        ({"logprobs": 1}, "logprobs", "invalid_type", "boolean"),
        ({"top_logprobs": 2}, "top_logprobs", "invalid_value", "`logprobs` must be set"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs", "invalid_value", "max allowed"),
        ({"logprobs": True, "top_logprobs": -1}, "top_logprobs", "invalid_value", "max allowed"),
        ({"logprobs": True, "top_logprobs": -2}, "top_logprobs", "invalid_value", "positive"),
        ({"logprobs": True, "top_logprobs": 1.5}, "top_logprobs", "invalid_type", "integer"),
        ({"logprobs": True, "prompt_logprobs": 1}, "prompt_logprobs", "unsupported_parameter", ""),
    ],
)
def test_chat_logprobs_errors(
    card: ModelCard, fields: dict[str, Any], param: str, code: str, words: str
) -> None:
    with pytest.raises(HttpError) as info:
        chat(card, **fields)
    err = info.value
    assert (err.status, err.param, err.code) == (400, param, code)
    assert words in err.message


def test_completion_limit_message_is_vllms(card: ModelCard) -> None:
    with pytest.raises(HttpError) as info:
        completion(card, logprobs=21)
    assert info.value.message == (
        "Requested sample logprobs of 21, which is greater than max allowed: 20"
    )


# -- formatting tables -----------------------------------------------------------------

H, E1, E2, L = 74, 130, 105, 78  # "h", the two bytes of "é", "l" in the tiny tokenizer


@pytest.mark.parametrize(
    ("top", "ids", "lps", "top_ids", "top_lps", "expected"),
    [
        # The sampled token is the top one: k entries, first k + 1 shown (all k).
        (
            2,
            [H],
            [-0.5],
            [H, L],
            [-0.5, -1.25],
            {
                "text_offset": [0],
                "token_logprobs": [-0.5],
                "tokens": ["h"],
                "top_logprobs": [{"h": -0.5, "l": -1.25}],
            },
        ),
        # Not among the top k: sampled first, then the top k (k + 1 entries).
        (
            1,
            [L],
            [-3.0],
            [H],
            [-0.1],
            {
                "text_offset": [0],
                "token_logprobs": [-3.0],
                "tokens": ["l"],
                "top_logprobs": [{"l": -3.0, "h": -0.1}],
            },
        ),
        # logprobs 0: the sampled token alone; -inf written as -9999.0.
        (
            0,
            [H, L],
            [-math.inf, -2.0],
            [],
            [],
            {
                "text_offset": [0, 1],
                "token_logprobs": [-9999.0, -2.0],
                "tokens": ["h", "l"],
                "top_logprobs": [{"h": -9999.0}, {"l": -2.0}],
            },
        ),
        # A character in two byte tokens: the first is "" (no context completes it),
        # the second the whole character (decoded after its first byte, vLLM's
        # correction); offsets count the token strings.
        (
            0,
            [H, E1, E2, L],
            [-1.0, -2.0, -3.0, -4.0],
            [],
            [],
            {
                "text_offset": [0, 1, 1, 2],
                "token_logprobs": [-1.0, -2.0, -3.0, -4.0],
                "tokens": ["h", "", "é", "l"],
                "top_logprobs": [{"h": -1.0}, {"": -2.0}, {"é": -3.0}, {"l": -4.0}],
            },
        ),
        # Special tokens are named, as vLLM decodes each id with them.
        (
            0,
            [2],
            [-0.25],
            [],
            [],
            {
                "text_offset": [0],
                "token_logprobs": [-0.25],
                "tokens": ["<|im_end|>"],
                "top_logprobs": [{"<|im_end|>": -0.25}],
            },
        ),
    ],
)
def test_completion_table(
    tiny: ModelCard,
    top: int,
    ids: list[int],
    lps: list[float],
    top_ids: list[int],
    top_lps: list[float],
    expected: dict[str, Any],
) -> None:
    got = ChoiceLogprobs(TokenNames(tiny.tokenizer), chat=False, top=top)
    assert got.take(ids, lps, top_ids, top_lps) == expected
    assert got.result() == expected


@pytest.mark.parametrize(
    ("top", "ids", "lps", "top_ids", "top_lps", "expected_tops"),
    [
        # top_logprobs 2 with the sampled token on top: both top tokens.
        (2, [H], [-0.5], [H, L], [-0.5, -1.5], [[("h", -0.5), ("l", -1.5)]]),
        # Not among them: the first k entries of vLLM's map, the sampled one first.
        (2, [L], [-3.0], [H, E1], [-0.1, -0.2], [[("l", -3.0), ("h", -0.1)]]),
        # top_logprobs 0: an empty list.
        (0, [H], [-0.5], [], [], [[]]),
    ],
)
def test_chat_table(
    tiny: ModelCard,
    top: int,
    ids: list[int],
    lps: list[float],
    top_ids: list[int],
    top_lps: list[float],
    expected_tops: list[list[tuple[str, float]]],
) -> None:
    got = ChoiceLogprobs(TokenNames(tiny.tokenizer), chat=True, top=top).take(
        ids, lps, top_ids, top_lps
    )
    names = TokenNames(tiny.tokenizer)
    assert got == {
        "content": [
            {
                "token": names.piece(tid),
                "logprob": lp,
                "bytes": list(names.piece(tid).encode()),
                "top_logprobs": [
                    {"token": t, "logprob": v, "bytes": list(t.encode())} for t, v in tops
                ],
            }
            for tid, lp, tops in zip(ids, lps, expected_tops, strict=True)
        ]
    }


def test_chat_bytes_of_a_split_character(tiny: ModelCard) -> None:
    got = ChoiceLogprobs(TokenNames(tiny.tokenizer), chat=True, top=0)
    first = got.take([E1], [-1.0], [], [])
    second = got.take([E2], [-2.0], [], [])  # the context carries over between batches
    assert [e["token"] for e in first["content"] + second["content"]] == ["", "é"]
    assert second["content"][0]["bytes"] == [0xC3, 0xA9]
    assert got.result() == {"content": first["content"] + second["content"]}


@pytest.mark.parametrize(
    ("lps", "top_ids", "top_lps"),
    [
        (None, [], []),
        ([-1.0], [], []),  # one logprob for two tokens
        ([-1.0, -2.0], [H], [-1.0]),  # top ids not a multiple of the tokens
        ([-1.0, -2.0], [H, L], [-1.0]),  # ids and values differ
    ],
)
def test_arrays_that_do_not_fit_are_refused(
    tiny: ModelCard, lps: list[float] | None, top_ids: list[int], top_lps: list[float]
) -> None:
    got = ChoiceLogprobs(TokenNames(tiny.tokenizer), chat=False, top=1)
    with pytest.raises(ValueError, match="do not fit"):
        got.take([H, L], lps, top_ids, top_lps)


# -- the relay -------------------------------------------------------------------------


def _events(raw: bytes) -> list[dict[str, Any]]:
    out = []
    for block in raw.decode().split("\n\n"):
        if block.startswith("data: ") and block != "data: [DONE]":
            out.append(json.loads(block[len("data: ") :]))
    return out


def _batch(ids: list[int], finish: Any = None, top: int = 1, index: int = 0) -> TokenBatch:
    return TokenBatch(
        ids,
        finish,
        index=index,
        logprobs=[-0.5] * len(ids),
        top_ids=[L] * (top * len(ids)),
        top_logprobs=[-1.5] * (top * len(ids)),
    )


def test_streamed_completion_sends_each_batch_with_its_logprobs(tiny: ModelCard) -> None:
    relay = Relay(completion(tiny, logprobs=1, stream=True, max_tokens=8), created=1)
    # "h" then the first byte of "é": the text is held back, the logprobs are not.
    chunks = _events(relay.feed(_batch([H, E1])))
    chunks += _events(relay.feed(_batch([E2], "length")))
    chunks += _events(relay.end())
    # The detokeniser held "h" back with the partial character; the chunk still goes.
    assert [c["choices"][0]["text"] for c in chunks] == ["", "hé"]
    first, last = (c["choices"][0]["logprobs"] for c in chunks)
    assert first == {
        "text_offset": [0, 1],
        "token_logprobs": [-0.5, -0.5],
        "tokens": ["h", ""],
        "top_logprobs": [{"h": -0.5, "l": -1.5}, {"": -0.5, "l": -1.5}],
    }
    # The offsets go on from the last chunk's (vLLM's next_text_offsets).
    assert last == {
        "text_offset": [1],
        "token_logprobs": [-0.5],
        "tokens": ["é"],
        "top_logprobs": [{"é": -0.5, "l": -1.5}],
    }
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_streamed_chat_chunk_with_no_text_still_carries_logprobs(tiny: ModelCard) -> None:
    relay = Relay(chat(tiny, logprobs=True, top_logprobs=1, stream=True), created=1)
    chunks = _events(relay.feed(_batch([E1])))
    role, held = chunks
    assert role["choices"][0] == {
        "index": 0,
        "delta": {"role": "assistant", "content": ""},
        "logprobs": None,
        "finish_reason": None,
    }
    assert held["choices"][0]["delta"] == {"content": ""}
    assert held["choices"][0]["logprobs"] == {
        "content": [
            {
                "token": "",
                "logprob": -0.5,
                "bytes": [],
                "top_logprobs": [{"token": "", "logprob": -0.5, "bytes": []}],
            }
        ]
    }
    (end,) = _events(relay.feed(_batch([E2, 2], "stop")))
    choice = end["choices"][0]
    assert choice["delta"] == {"content": "é"} and choice["finish_reason"] == "stop"
    assert [e["token"] for e in choice["logprobs"]["content"]] == ["é", "<|im_end|>"]


def test_non_streamed_response_joins_the_batches(tiny: ModelCard) -> None:
    relay = Relay(completion(tiny, logprobs=0, max_tokens=8, n=2), created=1)
    for index in (0, 1):
        relay.feed(_batch([H], top=0, index=index))
    relay.feed(_batch([E1, E2], "length", top=0, index=1))
    relay.feed(_batch([L], "length", top=0, index=0))
    resp = relay.response()
    assert [c["text"] for c in resp["choices"]] == ["hl", "hé"]
    assert resp["choices"][0]["logprobs"]["tokens"] == ["h", "l"]
    assert resp["choices"][1]["logprobs"] == {
        "text_offset": [0, 1, 1],
        "token_logprobs": [-0.5, -0.5, -0.5],
        "tokens": ["h", "", "é"],
        "top_logprobs": [{"h": -0.5}, {"": -0.5}, {"é": -0.5}],
    }


def test_stop_string_drops_the_logprobs_of_tokens_after_it(tiny: ModelCard) -> None:
    relay = Relay(completion(tiny, logprobs=0, max_tokens=8, stop=["h"]), created=1)
    relay.feed(_batch([L, H, L]))
    (choice,) = relay.response()["choices"]
    assert choice["finish_reason"] == "stop" and choice["text"] == "l"
    assert choice["logprobs"]["tokens"] == ["l", "h"]  # up to the token that completed it


def test_without_logprobs_the_shape_is_unchanged(tiny: ModelCard) -> None:
    relay = Relay(completion(tiny, max_tokens=8), created=1)
    relay.feed(TokenBatch([H], "length"))
    assert relay.response()["choices"][0]["logprobs"] is None


# -- the same objects as vLLM's server code -------------------------------------------


@pytest.fixture(scope="module")
def vllm_render() -> Render:
    return vllm_renderer(tiny_model_path())


_IDS = st.integers(0, 912)
# float32 values, as the engine's tensors hold them (the wire carries them as doubles)
_LPS = st.floats(-30.0, 0.0, width=32) | st.just(-math.inf)


@st.composite
def _rows(draw: st.DrawFn) -> tuple[int, list[tuple[int, float, list[tuple[int, float]]]]]:
    top = draw(st.integers(0, 4))
    text = draw(st.text(st.sampled_from("hél你好 lo🙂\n"), min_size=1, max_size=6))
    sampled = _tiny().encode(text)[:8]
    rows = []
    for tid in sampled:
        tops = draw(st.lists(st.tuples(_IDS | st.just(tid), _LPS), min_size=top, max_size=top))
        rows.append((tid, draw(_LPS), tops))
    return top, rows


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@pytest.mark.filterwarnings("ignore::FutureWarning")
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=_rows(), chat=st.booleans(), split=st.integers(1, 8))
def test_same_objects_as_vllm(
    tiny: ModelCard,
    vllm_render: Render,
    case: tuple[int, list[tuple[int, float, list[tuple[int, float]]]]],
    chat: bool,
    split: int,
) -> None:
    top, rows = case
    # The sampled token's own logprob in the top list is the same number (one tensor).
    rows = [(tid, lp, [(t, lp if t == tid else v) for t, v in tops]) for tid, lp, tops in rows]
    ours = ChoiceLogprobs(TokenNames(tiny.tokenizer), chat=chat, top=top)
    for start in range(0, len(rows), split):  # in batches, as the worker's deltas come
        part = rows[start : start + split]
        ours.take(
            [tid for tid, _, _ in part],
            [lp for _, lp, _ in part],
            [t for _, _, tops in part for t, _ in tops],
            [v for _, _, tops in part for _, v in tops],
        )
    expected = vllm_render(chat, top, rows)
    assert json.loads(json.dumps(ours.result())) == expected
