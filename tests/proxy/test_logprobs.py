"""Logprobs: parameters, formatting tables, and the same output as vLLM's server code.

The tables pin the shapes vLLM 0.32's OpenAI server writes (read from
``vllm/entrypoints/openai/{completion,chat_completion}/serving.py`` and
``vllm/v1/engine/logprobs.py``); the last test renders random sequences both
here and with vLLM's own functions (its ``LogprobsProcessor`` naming tokens
with the model's Hugging Face tokenizer, its servers' ``_create_*_logprobs``)
and requires equal objects.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from proxy.backend import TokenBatch
from proxy.http import HttpError, InStreamError
from proxy.logprobs import ChoiceLogprobs, TokenNames, prompt_entries, prompt_logprobs_json
from proxy.openai import ParsedRequest, Relay, parse_chat, parse_completion
from proxy.tokenizer import ModelCard
from star.model import tiny_model_path
from star.wire import PromptLogprobs
from tests.proxy.vllm_logprobs import PromptRender, Render, vllm_prompt_renderer, vllm_renderer

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
        ({"prompt_logprobs": 21}, "prompt_logprobs", "invalid_value", "prompt logprobs of 21"),
        ({"prompt_logprobs": -1}, "prompt_logprobs", "invalid_value", "max allowed: 20"),
        ({"prompt_logprobs": -3}, "prompt_logprobs", "invalid_value", "positive value or -1"),
        ({"prompt_logprobs": 2, "stream": True}, "prompt_logprobs", "invalid_value", "stream"),
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


@pytest.mark.parametrize(
    ("fields", "engine_k", "shown"),
    [
        # Asked for: computed and shown in the whole response (a vLLM extra).
        ({"prompt_logprobs": 3}, 3, 3),
        ({"prompt_logprobs": 0}, 0, 0),
        # echo scores the prompt as the output, unless prompt_logprobs says otherwise.
        ({"echo": True, "logprobs": 2}, 2, 2),
        ({"echo": True, "logprobs": 2, "prompt_logprobs": 4}, 4, 4),
        ({"echo": True}, None, None),
        # Streamed, only echo's logprobs show them; vLLM allows 0 there and shows nothing.
        ({"prompt_logprobs": 0, "stream": True}, None, None),
        ({"echo": True, "logprobs": 1, "stream": True}, 1, 1),
    ],
)
def test_completion_prompt_logprobs_reach_the_engine(
    card: ModelCard, fields: dict[str, Any], engine_k: int | None, shown: int | None
) -> None:
    parsed = completion(card, **fields)
    assert parsed.gen.sampling.get("prompt_logprobs") == engine_k
    assert parsed.text.prompt_logprobs == shown
    # They come with the first token and are never computed again: migratable.
    assert parsed.gen.migratable is True


@pytest.mark.parametrize(
    ("fields", "engine_k"),
    [
        ({"prompt_logprobs": 2}, 2),
        # vLLM's chat echo asks for the prompt's logprobs at top_logprobs (0 by default).
        ({"echo": True}, 0),
        ({"echo": True, "logprobs": True, "top_logprobs": 3}, 3),
        ({"echo": True, "prompt_logprobs": 1}, 1),
        # Shown only in a whole response.
        ({"echo": True, "stream": True}, None),
        ({"prompt_logprobs": 0, "stream": True}, None),
    ],
)
def test_chat_prompt_logprobs_reach_the_engine(
    card: ModelCard, fields: dict[str, Any], engine_k: int | None
) -> None:
    parsed = chat(card, **fields)
    assert parsed.gen.sampling.get("prompt_logprobs") == engine_k
    assert parsed.text.prompt_logprobs == engine_k
    assert parsed.gen.migratable is True


def test_completion_limit_message_is_vllms(card: ModelCard) -> None:
    with pytest.raises(HttpError) as info:
        completion(card, logprobs=21)
    assert info.value.message == (
        "Requested sample logprobs of 21, which is greater than max allowed: 20"
    )
    assert not isinstance(info.value, InStreamError)


@pytest.mark.parametrize(
    ("parse", "fields"),
    [
        (completion, {"logprobs": 21}),
        (chat, {"logprobs": True, "top_logprobs": 30}),
    ],
)
def test_a_stream_over_the_limit_carries_the_error_as_vllm_does(
    card: ModelCard, parse: Any, fields: dict[str, Any]
) -> None:
    # vLLM's engine checks it after the server began the stream: 200, the error, [DONE].
    with pytest.raises(InStreamError) as info:
        parse(card, stream=True, **fields)
    assert info.value.status == 400 and "greater than max allowed: 20" in info.value.message
    # An error vLLM's request model finds first is still a 400 before any stream.
    with pytest.raises(HttpError) as first:
        parse(card, stream=True, max_tokens=0, **fields)
    assert not isinstance(first.value, InStreamError)


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


def _prompt(
    prompt: list[int], k: int, lp: float = -2.0, rank: int = 3, top: tuple[int, ...] = ()
) -> PromptLogprobs:
    """Prompt logprobs: every scored position the same, its top k ``top`` (default ``L``s)."""
    n = len(prompt) - 1
    ids = list(top) if top else [L] * k
    return PromptLogprobs(
        0,
        logprobs=[lp] * n,
        ranks=[rank] * n,
        top_ids=ids * n,
        top_logprobs=[-0.5 - j for j in range(k)] * n,
    )


def test_prompt_entries_table(tiny: ModelCard) -> None:
    names = TokenNames(tiny.tokenizer)
    prompt = [H, E1, E2, L]
    scores = PromptLogprobs(
        0,
        logprobs=[-1.0, -2.0, -math.inf],
        ranks=[4, 1, 900],
        # k = 2: "é"'s first byte not among them; its second byte first there;
        # "l" outside them.
        top_ids=[H, L, E2, H, H, E1],
        top_logprobs=[-0.5, -0.75, -2.0, -3.0, -0.25, -0.5],
    )
    entries = prompt_entries(names, prompt, scores)
    assert entries == [
        None,
        # The prompt token first with its rank, then the top 2 ranked 1 and 2; its
        # bytes decode to "" with no prompt token before it that completes them.
        {E1: (-1.0, 4, ""), H: (-0.5, 1, "h"), L: (-0.75, 2, "l")},
        # Among the top: one entry, in the prompt token's place, the top entry's rank;
        # named after the preceding scored prompt token (the first byte): "é".
        {E2: (-2.0, 1, "é"), H: (-3.0, 2, "h")},
        {L: (-math.inf, 900, "l"), H: (-0.25, 1, "h"), E1: (-0.5, 2, "")},
    ]
    assert prompt_logprobs_json(entries) == [
        None,
        {
            str(E1): {"logprob": -1.0, "rank": 4, "decoded_token": ""},
            str(H): {"logprob": -0.5, "rank": 1, "decoded_token": "h"},
            str(L): {"logprob": -0.75, "rank": 2, "decoded_token": "l"},
        },
        {
            str(E2): {"logprob": -2.0, "rank": 1, "decoded_token": "é"},
            str(H): {"logprob": -3.0, "rank": 2, "decoded_token": "h"},
        },
        {
            str(L): {"logprob": -9999.0, "rank": 900, "decoded_token": "l"},
            str(H): {"logprob": -0.25, "rank": 1, "decoded_token": "h"},
            str(E1): {"logprob": -0.5, "rank": 2, "decoded_token": ""},
        },
    ]
    # Echo's logprobs (k = 1): the first prompt token without logprobs, then each
    # position's first k + 1 entries; offsets count the strings.
    echo = ChoiceLogprobs(names, chat=False, top=1).take_prompt(prompt, entries)
    assert echo == {
        "text_offset": [0, 1, 1, 2],
        "token_logprobs": [None, -1.0, -2.0, -9999.0],
        "tokens": ["h", "", "é", "l"],
        "top_logprobs": [
            None,
            {"": -1.0, "h": -0.5},
            {"é": -2.0, "h": -3.0},
            {"l": -9999.0, "h": -0.25},
        ],
    }
    with pytest.raises(ValueError, match="do not fit 5 tokens"):
        prompt_entries(names, [*prompt, H], scores)


def test_completion_response_carries_prompt_logprobs(tiny: ModelCard) -> None:
    parsed = completion(tiny, prompt=[H, L], prompt_logprobs=1, max_tokens=4, n=2)
    relay = Relay(parsed, created=1)
    for index in (0, 1):
        relay.feed(TokenBatch([L], "length", index=index, prompt=_prompt([H, L], 1, top=(H,))))
    field = [
        None,
        {
            str(L): {"logprob": -2.0, "rank": 3, "decoded_token": "l"},
            str(H): {"logprob": -0.5, "rank": 1, "decoded_token": "h"},
        },
    ]
    for choice in relay.response()["choices"]:
        assert list(choice) == [  # vLLM's CompletionResponseChoice, in its order
            "index",
            "text",
            "logprobs",
            "finish_reason",
            "stop_reason",
            "token_ids",
            "prompt_logprobs",
            "prompt_token_ids",
            "routed_experts",
        ]
        assert choice["prompt_logprobs"] == field and choice["logprobs"] is None


def test_a_first_batch_without_the_prompt_logprobs_is_refused(tiny: ModelCard) -> None:
    relay = Relay(completion(tiny, prompt_logprobs=0, max_tokens=4), created=1)
    with pytest.raises(ValueError, match="no prompt logprobs"):
        relay.feed(TokenBatch([L], "length"))


def test_echo_with_logprobs_starts_with_the_prompts(tiny: ModelCard) -> None:
    prompt = [H, L]
    for stream in (False, True):
        parsed = completion(tiny, prompt=prompt, echo=True, logprobs=1, max_tokens=4, stream=stream)
        assert parsed.gen.sampling["prompt_logprobs"] == 1
        relay = Relay(parsed, created=1)
        out = relay.feed(
            TokenBatch(
                [H],
                None,
                logprobs=[-0.25],
                top_ids=[H],
                top_logprobs=[-0.25],
                prompt=_prompt(prompt, 1, top=(H,)),
            )
        )
        out += relay.feed(_batch([L], "length"))
        want = {
            "text_offset": [0, 1, 2, 3],
            # (_batch's sampled "l" is its top token too: the later value, as in vLLM's map)
            "token_logprobs": [None, -2.0, -0.25, -1.5],
            "tokens": ["h", "l", "h", "l"],
            "top_logprobs": [None, {"l": -2.0, "h": -0.5}, {"h": -0.25}, {"l": -1.5}],
        }
        if not stream:
            (choice,) = relay.response()["choices"]
            assert choice["text"] == "hlhl" and choice["logprobs"] == want
            assert choice["prompt_logprobs"][1][str(L)]["rank"] == 3
            continue
        first, last = (e["choices"][0] for e in _events(out))
        assert first["text"] == "hlh" and last["text"] == "l"
        # The first chunk: the prompt's and the first token's; then the rest's.
        got = {k: first["logprobs"][k] + last["logprobs"][k] for k in want}
        assert got == want and "prompt_logprobs" not in first


def test_echo_with_logprobs_and_no_tokens_shows_the_prompts_alone(tiny: ModelCard) -> None:
    # max_tokens 0: vLLM runs one token and shows neither its text nor its logprobs.
    for stream in (False, True):
        parsed = completion(tiny, prompt=[H, L], echo=True, logprobs=0, max_tokens=0, stream=stream)
        relay = Relay(parsed, created=1)
        out = relay.feed(
            TokenBatch(
                [E1],
                "length",
                logprobs=[-0.25],
                top_ids=[],
                top_logprobs=[],
                prompt=_prompt([H, L], 0),
            )
        )
        want = {
            "text_offset": [0, 1],
            "token_logprobs": [None, -2.0],
            "tokens": ["h", "l"],
            "top_logprobs": [None, {"l": -2.0}],
        }
        if stream:
            (chunk,) = _events(out)
            assert chunk["choices"][0]["text"] == "hl" and chunk["choices"][0]["logprobs"] == want
        else:
            (choice,) = relay.response()["choices"]
            assert choice["text"] == "hl" and choice["logprobs"] == want
            assert relay.response()["usage"]["completion_tokens"] == 1


def test_chat_echo_and_prompt_logprobs(tiny: ModelCard) -> None:
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Once"}]
    body = {"messages": messages, "echo": True, "add_generation_prompt": False}
    parsed = chat(tiny, **body)
    # Without a generation prompt the response takes the last message's role, and
    # echo repeats that message's content.
    assert (parsed.role, parsed.chat_echo) == ("assistant", "Once")
    prompt = parsed.gen.prompt_token_ids
    relay = Relay(parsed, created=1)
    relay.feed(TokenBatch([L], "length", prompt=_prompt(prompt, 0)))
    resp = relay.response()
    message = resp["choices"][0]["message"]
    assert (message["role"], message["content"]) == ("assistant", "Oncel")
    assert list(resp).index("prompt_logprobs") == list(resp).index("usage") + 1  # vLLM's order
    assert len(resp["prompt_logprobs"]) == len(prompt) and resp["prompt_logprobs"][0] is None
    assert all(len(e) == 1 for e in resp["prompt_logprobs"][1:])  # top_logprobs 0: the token
    # Streamed: the role chunk, the echo chunk, then the text; no prompt logprobs.
    streamed = chat(tiny, stream=True, **body)
    assert "prompt_logprobs" not in streamed.gen.sampling
    relay = Relay(streamed, created=1)
    chunks = _events(relay.feed(TokenBatch([L], "length")) + relay.end())
    assert [c["choices"][0]["delta"] for c in chunks] == [
        {"role": "assistant", "content": ""},
        {"content": "Once"},
        {"content": "l"},
    ]
    # A user message last, with a generation prompt: nothing to echo, but vLLM
    # still makes the content a string; the role is the last message's without one.
    plain = chat(tiny, echo=True)
    assert (plain.role, plain.chat_echo) == ("assistant", "")
    user_role = chat(tiny, add_generation_prompt=False, echo=True)
    assert (user_role.role, user_role.chat_echo) == ("user", "hi")
    relay = Relay(
        dataclasses.replace(
            user_role, text=dataclasses.replace(user_role.text, prompt_logprobs=None)
        ),
        created=1,
    )
    relay.feed(TokenBatch([L], "length"))
    message = relay.response()["choices"][0]["message"]
    assert (message["role"], message["content"]) == ("user", "hil")


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
@given(case=_rows(), chat=st.booleans(), split=st.integers(1, 8), as_ids=st.booleans())
def test_same_objects_as_vllm(
    tiny: ModelCard,
    vllm_render: Render,
    case: tuple[int, list[tuple[int, float, list[tuple[int, float]]]]],
    chat: bool,
    split: int,
    as_ids: bool,
) -> None:
    """``as_ids``: return_tokens_as_token_ids."""
    top, rows = case
    # The sampled token's own logprob in the top list is the same number (one tensor).
    rows = [(tid, lp, [(t, lp if t == tid else v) for t, v in tops]) for tid, lp, tops in rows]
    ours = ChoiceLogprobs(TokenNames(tiny.tokenizer), chat=chat, top=top, as_ids=as_ids)
    for start in range(0, len(rows), split):  # in batches, as the worker's deltas come
        part = rows[start : start + split]
        ours.take(
            [tid for tid, _, _ in part],
            [lp for _, lp, _ in part],
            [t for _, _, tops in part for t, _ in tops],
            [v for _, _, tops in part for _, v in tops],
        )
    expected = vllm_render(chat, top, rows, as_ids)
    assert json.loads(json.dumps(ours.result())) == expected


@pytest.fixture(scope="module")
def vllm_prompt_render() -> PromptRender:
    return vllm_prompt_renderer(tiny_model_path())


@st.composite
def _prompt_rows(
    draw: st.DrawFn,
) -> tuple[list[int], int, list[tuple[int, float, int, list[tuple[int, float]]]]]:
    k = draw(st.integers(0, 4))
    text = draw(st.text(st.sampled_from("hél你好 lo🙂\n"), min_size=1, max_size=6))
    prompt = _tiny().encode(text)[:10]
    if len(prompt) < 2:
        prompt = [H, *prompt]
    rows = []
    for tid in prompt[1:]:
        lp = draw(_LPS)
        tops = draw(st.lists(st.tuples(_IDS | st.just(tid), _LPS), min_size=k, max_size=k))
        # The prompt token's own logprob is one number wherever it appears.
        tops = [(t, lp if t == tid else v) for t, v in tops]
        rows.append((tid, lp, draw(st.integers(1, 913)), tops))
    return prompt, k, rows


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@pytest.mark.filterwarnings("ignore::FutureWarning")
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=_prompt_rows(), out=_rows(), as_ids=st.booleans())
def test_prompt_logprobs_same_objects_as_vllm(
    tiny: ModelCard,
    vllm_prompt_render: PromptRender,
    case: tuple[list[int], int, list[tuple[int, float, int, list[tuple[int, float]]]]],
    out: tuple[int, list[tuple[int, float, list[tuple[int, float]]]]],
    as_ids: bool,
) -> None:
    prompt, k, rows = case
    top, out_rows = out
    out_rows = [(t, lp, [(i, lp if i == t else v) for i, v in tops]) for t, lp, tops in out_rows]
    scores = PromptLogprobs(
        0,
        logprobs=[lp for _, lp, _, _ in rows],
        ranks=[rank for _, _, rank, _ in rows],
        top_ids=[t for _, _, _, tops in rows for t, _ in tops],
        top_logprobs=[v for _, _, _, tops in rows for _, v in tops],
    )
    names = TokenNames(tiny.tokenizer)
    entries = prompt_entries(names, prompt, scores)
    # vLLM's engine writes float32: the wire carries them as doubles of the same value.
    expected = vllm_prompt_render(prompt, k, rows, out_rows, top, as_ids)
    assert json.loads(json.dumps(prompt_logprobs_json(entries))) == expected["prompt_logprobs"]
    # echo: the prompt's logprobs then the output's, in one completion logprobs object.
    ours = ChoiceLogprobs(names, chat=False, top=top, as_ids=as_ids)
    ours.take_prompt(prompt, entries)
    ours.take(
        [t for t, _, _ in out_rows],
        [lp for _, lp, _ in out_rows],
        [i for _, _, tops in out_rows for i, _ in tops],
        [v for _, _, tops in out_rows for _, v in tops],
    )
    assert json.loads(json.dumps(ours.result())) == expected["echo"]


# -- continue_final_message ----------------------------------------------------------------


def test_continue_final_message_renders_as_transformers_does(tiny: ModelCard) -> None:
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(str(tiny_model_path()))
    convs = [
        [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Once upon"}],
        [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "trailing "}],
        [{"role": "user", "content": "go on"}],
    ]
    for messages in convs:
        text = hf.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=False, continue_final_message=True
        )
        assert tiny.render_chat(messages, False, continue_final_message=True) == text
    # The prompt ends inside the assistant's message; echo repeats that message.
    body = {"continue_final_message": True, "add_generation_prompt": False, "echo": True}
    parsed = chat(tiny, messages=convs[0], max_tokens=2, **body)
    assert tiny.tokenizer.decode(list(parsed.gen.prompt_token_ids)).endswith("Once upon")
    assert (parsed.role, parsed.chat_echo) == ("assistant", "Once upon")


def test_continue_final_message_with_a_generation_prompt_is_refused(tiny: ModelCard) -> None:
    # Sent as true: vLLM's request model refuses it; left at its default (true): transformers.
    with pytest.raises(HttpError, match="Cannot set both `continue_final_message` and"):
        chat(tiny, continue_final_message=True, add_generation_prompt=True)
    with pytest.raises(HttpError, match="continue_final_message and add_generation_prompt are"):
        chat(tiny, continue_final_message=True)
    with pytest.raises(HttpError, match="may not set continue_final_message"):
        chat(tiny, chat_template_kwargs={"continue_final_message": True})
