"""OpenAI request validation and response shapes, without sockets."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import pytest

from proxy import sse
from proxy.backend import TokenBatch
from proxy.fanout import children
from proxy.http import HttpError, InStreamError
from proxy.openai import (
    FINGERPRINT,
    ParsedRequest,
    Relay,
    models_payload,
    parse_chat,
    parse_completion,
)
from proxy.resume import context_of, request_of
from proxy.tokenizer import ModelCard, compile_template

MODEL = "tiny"


def body(**kw: Any) -> bytes:
    return json.dumps({"model": MODEL, **kw}).encode()


def completion(card: ModelCard, **kw: Any) -> ParsedRequest:
    return parse_completion(body(prompt=kw.pop("prompt", "hello"), **kw), {MODEL: card})


def chat(card: ModelCard, **kw: Any) -> ParsedRequest:
    messages = kw.pop("messages", [{"role": "user", "content": "hi"}])
    return parse_chat(body(messages=messages, **kw), {MODEL: card})


@pytest.mark.parametrize(
    ("fields", "param", "code"),
    [
        ({"max_tokens": "16"}, "max_tokens", "invalid_type"),
        ({"max_tokens": 0}, "max_tokens", "invalid_value"),
        ({"max_tokens": -1, "echo": True}, "max_tokens", "invalid_value"),
        ({"max_tokens": True}, "max_tokens", "invalid_type"),
        ({"temperature": 2.5}, "temperature", "invalid_value"),
        ({"temperature": "hot"}, "temperature", "invalid_type"),
        ({"top_p": 0}, "top_p", "invalid_value"),
        ({"top_k": -2}, "top_k", "invalid_value"),
        ({"presence_penalty": -3}, "presence_penalty", "invalid_value"),
        ({"n": 0}, "n", "invalid_value"),
        ({"stop": 5}, "stop", "invalid_type"),
        ({"stop": ["a"] * 17}, "stop", "invalid_value"),
        ({"stream": "yes"}, "stream", "invalid_type"),
        ({"stream_options": {"include_usage": True}}, "stream_options", "invalid_value"),
        ({"stop_token_ids": [10**9]}, "stop_token_ids", "invalid_value"),
        ({"logit_bias": {"x": 1}}, "logit_bias", "invalid_value"),
        ({"logprobs": 21}, "logprobs", "invalid_value"),
        ({"logprobs": -1}, "logprobs", "invalid_value"),
        ({"logprobs": -2}, "logprobs", "invalid_value"),
        ({"logprobs": "2"}, "logprobs", "invalid_type"),
        ({"prompt_logprobs": 1, "stream": True}, "prompt_logprobs", "invalid_value"),
        ({"prompt_logprobs": -1, "stream": True}, "prompt_logprobs", "invalid_value"),
        ({"prompt_logprobs": -2}, "prompt_logprobs", "invalid_value"),
        ({"prompt_logprobs": "1"}, "prompt_logprobs", "invalid_type"),
        ({"echo": "yes"}, "echo", "invalid_type"),
        ({"suffix": "x"}, "suffix", "unsupported_parameter"),
        ({"prompt": [1, "x"]}, "prompt", "invalid_type"),
        ({"prompt": ["a", [1, 2]]}, "prompt", "invalid_type"),
        ({"prompt": [[1, 2], []]}, "prompt", "invalid_value"),
        ({"prompt": ["a", [10**9]]}, "prompt", "invalid_type"),
        ({"prompt": [[1], [10**9]]}, "prompt", "invalid_value"),
        ({"prompt": ["a"] * 65, "n": 2}, "prompt", "invalid_value"),
        ({"n": 129}, "n", "invalid_value"),
        ({"prompt": [10**9]}, "prompt", "invalid_value"),
        ({"prompt": None}, "prompt", "missing_required_parameter"),
        ({"max_tokens": 100_000}, "max_tokens", "invalid_value"),  # past max_model_len
        ({"response_format": {"type": "xml"}}, "response_format", "invalid_value"),
    ],
)
def test_completion_bad_params_name_the_param(
    card: ModelCard, fields: dict[str, Any], param: str, code: str
) -> None:
    with pytest.raises(HttpError) as info:
        completion(card, **fields)
    err = info.value
    assert (err.status, err.param, err.code) == (400, param, code)
    assert err.type == "BadRequestError"
    assert param in err.message or code in ("context_length_exceeded", "missing_required_parameter")


@pytest.mark.parametrize(
    ("raw", "status", "code"),
    [
        (b"{not json", 400, "invalid_json"),
        (b"[1, 2]", 400, "invalid_json"),
        (b'{"model": "tiny", "prompt": "x", "temperature": NaN}', 400, "invalid_json"),
        (b'{"prompt": "x"}', 400, "missing_required_parameter"),
        (b'{"model": "gpt-9", "prompt": "x"}', 404, "model_not_found"),
    ],
)
def test_body_and_model_errors(card: ModelCard, raw: bytes, status: int, code: str) -> None:
    with pytest.raises(HttpError) as info:
        parse_completion(raw, {MODEL: card})
    assert (info.value.status, info.value.code) == (status, code)


@pytest.mark.parametrize(
    ("messages", "param"),
    [
        ([], "messages"),
        ("hi", "messages"),
        ([{"role": "robot", "content": "x"}], "messages[0].role"),
        ([{"role": "user", "content": 5}], "messages[0].content"),
        (
            [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}],
            "messages[0].content[0]",
        ),
    ],
)
def test_chat_bad_messages(card: ModelCard, messages: Any, param: str) -> None:
    with pytest.raises(HttpError) as info:
        chat(card, messages=messages)
    assert (info.value.status, info.value.param) == (400, param)


def test_chat_refuses_auto_tools_without_a_parser_and_template_errors(card: ModelCard) -> None:
    # As vLLM's server without --enable-auto-tool-choice (tests/proxy/test_chat_tools.py)
    with pytest.raises(HttpError) as info:
        chat(card, tools=[{"type": "function", "function": {"name": "f"}}])
    assert info.value.param == "tool_choice"
    assert "proxy.enable_auto_tool_choice" in info.value.message
    strict = ModelCard(
        name=MODEL,
        tokenizer=card.tokenizer,
        chat_template="{% if messages[0]['role'] != 'user' %}{{ raise_exception('user first') }}{% endif %}x",
    )
    with pytest.raises(HttpError) as info:
        parse_chat(body(messages=[{"role": "system", "content": "s"}]), {MODEL: strict})
    assert (info.value.status, info.value.message) == (400, "user first")


def test_chat_template_failures_are_400(card: ModelCard) -> None:
    # A null content renders as "" (as vLLM renders it: tests/proxy/test_chat_history.py);
    # a tool call that is not an object is refused, as vLLM refuses it.
    messages = [{"role": "assistant", "content": None, "tool_calls": ["not an object"]}]
    with pytest.raises(HttpError) as info:
        chat(card, messages=messages)
    assert (info.value.status, info.value.param) == (400, "messages")
    assert info.value.message == "assistant tool_calls entries must be objects."
    failing = ModelCard(name=MODEL, tokenizer=card.tokenizer, chat_template="{{ 1 + 'a' }}")
    with pytest.raises(HttpError) as info:  # a template that fails on what it is given
        chat(failing)
    assert (info.value.status, info.value.param) == (400, "messages")
    assert info.value.message.startswith("chat template failed:")
    with pytest.raises(HttpError) as info:
        chat(card, chat_template_kwargs={"messages": []})
    assert (info.value.status, info.value.param) == (400, "chat_template_kwargs")


def test_completion_request_becomes_a_generation_request(card: ModelCard) -> None:
    p = completion(
        card,
        prompt="hello world",
        max_tokens=7,
        temperature=0.5,
        top_k=5,
        stop="STOP",
        stop_token_ids=[3],
        ignore_eos=True,
        min_tokens=2,
        stream=True,
        stream_options={"include_usage": True},
        user="u",
        store=False,
    )
    g = p.gen
    assert g.request_id.startswith("cmpl-") and len(g.request_id) == 37
    assert g.prompt_token_ids == card.tokenizer.encode("hello world").ids
    assert g.sampling == {
        "max_tokens": 7,
        "temperature": 0.5,
        "top_k": 5,
        "stop_token_ids": [3],
        "ignore_eos": True,
        "min_tokens": 2,
    }
    assert (g.stop, g.stream, g.include_usage, g.kind, g.migratable) == (
        ("STOP",),
        True,
        True,
        "completion",
        True,
    )
    assert p.text.min_tokens == 2
    assert completion(card).gen.max_tokens == 16  # OpenAI's completions default
    assert completion(card, prompt=[5, 6, 7]).gen.prompt_token_ids == [5, 6, 7]
    assert completion(card, prompt=[[5, 6]]).gen.prompt_token_ids == [5, 6]


@pytest.mark.parametrize(
    ("fields", "migratable"),
    [
        ({}, True),
        ({"temperature": 0.8, "top_p": 0.9, "logit_bias": {"5": 2}}, True),
        # A true continuation carries the seeded stream and the generated tokens.
        ({"seed": 1}, True),
        ({"presence_penalty": 0.5}, True),
        ({"frequency_penalty": 0.1}, True),
        ({"repetition_penalty": 1.1}, True),
        ({"repetition_penalty": 1.0}, True),
        ({"n": 2}, True),  # fanned out into single requests, each migratable
        ({"n": 2, "seed": 1}, True),
        ({"logprobs": 1}, True),
        # Its grammar is replayed on the target.
        ({"response_format": {"type": "json_object"}}, True),
        ({"guided_regex": "a+"}, True),
    ],
)
def test_migratable_flag(card: ModelCard, fields: dict[str, Any], migratable: bool) -> None:
    assert completion(card, **fields).gen.migratable is migratable


def test_structured_outputs_are_vllm_kwargs(card: ModelCard) -> None:
    schema = {"type": "object"}
    p = chat(
        card,
        response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}},
    )
    assert p.gen.sampling["structured_outputs"] == {"json": schema}


def test_chat_prompt_uses_the_template_and_default_max_tokens(card: ModelCard) -> None:
    p = chat(
        card,
        messages=[
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "hi"}]},
        ],
    )
    expected = "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert card.tokenizer.decode(p.gen.prompt_token_ids, skip_special_tokens=False) == expected
    assert p.gen.request_id.startswith("chatcmpl-")
    assert p.gen.max_tokens == card.max_model_len - len(p.gen.prompt_token_ids)
    assert chat(card, max_completion_tokens=9, max_tokens=3).gen.max_tokens == 9


def test_template_filters_match_transformers() -> None:
    t = compile_template("{{ x | tojson }}|{{ raise_exception is defined }}")
    assert t.render(x={"a": "é<"}) == '{"a": "é<"}|True'


# -- response shapes ---------------------------------------------------------------


def run_relay(p: ParsedRequest, batches: list[TokenBatch]) -> tuple[Relay, list[Any]]:
    relay = Relay(p, created=123)
    out = b""
    for b in batches:
        out += relay.feed(b)
        if relay.done:
            break
    out += relay.end()
    events = [e.data for e in sse.SSEDecoder().feed(out)]
    assert events[-1] == "[DONE]"
    return relay, [json.loads(e) for e in events[:-1]]


def ids(card: ModelCard, text: str) -> list[int]:
    return list(card.tokenizer.encode(text).ids)


def test_completion_stream_chunks_have_vllms_shape(card: ModelCard) -> None:
    p = completion(card, stream=True, stream_options={"include_usage": True})
    a, b = ids(card, "Hello"), ids(card, " 你好")
    _, chunks = run_relay(p, [TokenBatch(a), TokenBatch(b, "length")])
    rid = p.gen.request_id
    # vLLM 0.32's chunks (model_dump_json(exclude_unset=True)): no usage on a
    # token chunk, the token ids it was not asked to return as null.
    base = {"id": rid, "object": "text_completion", "created": 123, "model": MODEL}
    ids_null = {"prompt_token_ids": None, "token_ids": None}
    assert chunks == [
        {
            **base,
            "choices": [
                {
                    "index": 0,
                    "text": "Hello",
                    "logprobs": None,
                    "finish_reason": None,
                    "stop_reason": None,
                    **ids_null,
                }
            ],
        },
        {
            **base,
            "choices": [
                {
                    "index": 0,
                    "text": " 你好",
                    "logprobs": None,
                    "finish_reason": "length",
                    "stop_reason": None,
                    **ids_null,
                }
            ],
        },
        {
            **base,
            "choices": [],
            "usage": {
                "prompt_tokens": len(p.gen.prompt_token_ids),
                "completion_tokens": len(a) + len(b),
                "total_tokens": len(p.gen.prompt_token_ids) + len(a) + len(b),
            },
            "system_fingerprint": FINGERPRINT,  # where vLLM stamps its own
        },
    ]


def test_chat_stream_chunks_have_vllms_shape(card: ModelCard) -> None:
    p = chat(card, stream=True)
    _, chunks = run_relay(p, [TokenBatch(ids(card, "Hi")), TokenBatch([], "stop", 9)])
    base = {
        "id": p.gen.request_id,
        "object": "chat.completion.chunk",
        "created": 123,
        "model": MODEL,
    }
    assert chunks == [
        {
            **base,
            "choices": [
                {
                    "index": 0,
                    "delta": {"role": "assistant", "content": ""},
                    "logprobs": None,
                    "finish_reason": None,
                }
            ],
            # vLLM names the prompt on a choice's first chunk (null unless asked)
            "prompt_token_ids": None,
            "prompt_text": None,
        },
        {
            **base,
            "choices": [
                {
                    "index": 0,
                    "delta": {"content": "Hi"},
                    "logprobs": None,
                    "finish_reason": None,
                    "token_ids": None,
                }
            ],
        },
        # vLLM: a chat chunk names the stop token id (stop_reason) on its finishing chunk only
        {
            **base,
            "choices": [
                {
                    "index": 0,
                    "delta": {},
                    "logprobs": None,
                    "finish_reason": "stop",
                    "stop_reason": 9,
                    "token_ids": None,
                }
            ],
            "system_fingerprint": FINGERPRINT,  # the finishing chunk, with no usage chunk
        },
    ]


def test_stop_string_ends_the_relay_and_n_choices_are_separate(card: ModelCard) -> None:
    p = completion(card, stop=["42"], n=2, max_tokens=50)
    relay = Relay(p, created=1)
    tokens = ids(card, "The answer is 42. More")
    for i in range(2):
        for t in tokens:
            relay.feed(TokenBatch([t], index=i))
            if relay.choices[i].finished:
                break
    assert relay.done
    resp = relay.response()
    assert resp["object"] == "text_completion"
    assert [c["text"] for c in resp["choices"]] == ["The answer is "] * 2
    assert [c["finish_reason"] for c in resp["choices"]] == ["stop", "stop"]
    assert [c["stop_reason"] for c in resp["choices"]] == ["42", "42"]  # vLLM: the stop string
    assert resp["usage"]["completion_tokens"] == 2 * relay.choices[0].num_tokens
    assert relay.choices[0].num_tokens < len(tokens)


def test_chat_response_shape(card: ModelCard) -> None:
    p = chat(card)
    relay = Relay(p, created=5)
    # The engine stops on stop token 7: counted, its text left out (vLLM's detokenizer).
    relay.feed(TokenBatch([*ids(card, "café 😀"), 7], "stop", 7))
    resp = relay.response()
    assert resp == {
        "id": p.gen.request_id,
        "object": "chat.completion",
        "created": 5,
        "model": MODEL,
        "choices": [
            {
                "index": 0,
                # vLLM's ChatMessage.model_dump(): its placeholders null, no empty tool_calls
                "message": {
                    "role": "assistant",
                    "content": "café 😀",
                    "refusal": None,
                    "annotations": None,
                    "audio": None,
                    "function_call": None,
                    "reasoning": None,
                },
                "logprobs": None,
                "finish_reason": "stop",
                "stop_reason": 7,  # vLLM: the stop token id the engine stopped on
                "token_ids": None,
                "routed_experts": None,
            }
        ],
        "service_tier": None,
        "system_fingerprint": FINGERPRINT,  # vLLM: vllm-<version>-<config hash>
        "usage": {
            "prompt_tokens": len(p.gen.prompt_token_ids),
            "completion_tokens": len(ids(card, "café 😀")) + 1,
            "total_tokens": len(p.gen.prompt_token_ids) + len(ids(card, "café 😀")) + 1,
            "prompt_tokens_details": None,
            "completion_tokens_details": None,
        },
        "prompt_logprobs": None,
        "prompt_token_ids": None,
        "prompt_text": None,
        "kv_transfer_params": None,
        "ec_transfer_params": None,
        "metrics": None,
    }


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # importing vLLM (torch.jit)
@pytest.mark.filterwarnings("ignore::FutureWarning")
@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_a_whole_answer_has_the_fields_of_vllms_own(card: ModelCard, kind: str) -> None:
    """Field for field what the installed vLLM's response model dumps (its
    server answers with model_dump()): a field vLLM adds fails here."""
    import vllm.entrypoints.openai.chat_completion.protocol as chat_protocol
    import vllm.entrypoints.openai.completion.protocol as completion_protocol
    from vllm.entrypoints.serve.engine.protocol import UsageInfo

    from benchmarks.conformance import field_paths

    p = chat(card) if kind == "chat" else completion(card)
    relay = Relay(p, created=5)
    relay.feed(TokenBatch(ids(card, "Hi there"), "length"))
    usage = UsageInfo(prompt_tokens=3, total_tokens=5, completion_tokens=2)
    if kind == "chat":
        message = chat_protocol.ChatMessage(role="assistant", content="Hi there")
        theirs: Any = chat_protocol.ChatCompletionResponse(
            model=MODEL,
            choices=[
                chat_protocol.ChatCompletionResponseChoice(
                    index=0, message=message, finish_reason="length"
                )
            ],
            usage=usage,
        )
    else:
        theirs = completion_protocol.CompletionResponse(
            model=MODEL,
            choices=[
                completion_protocol.CompletionResponseChoice(
                    index=0, text="Hi there", finish_reason="length"
                )
            ],
            usage=usage,
        )
    assert field_paths(relay.response()) == field_paths(theirs.model_dump())


def test_relay_refuses_a_stream_that_never_finished(card: ModelCard) -> None:
    relay = Relay(completion(card))
    relay.feed(TokenBatch([5]))
    with pytest.raises(RuntimeError):
        relay.response()
    with pytest.raises(ValueError):
        relay.feed(TokenBatch([5], index=3))


def test_models_payload(card: ModelCard) -> None:
    assert models_payload([card]) == {
        "object": "list",
        "data": [{"id": MODEL, "object": "model", "created": card.created, "owned_by": "star"}],
    }


def test_sse_decoder_handles_any_split() -> None:
    stream = b"data: a\r\n\r\n: ping\n\ndata: b\ndata: c\r\rdata: [DONE]\n\n"
    whole = [e.data for e in sse.SSEDecoder().feed(stream)]
    assert whole == ["a", "b\nc", "[DONE]"]
    for cut in range(len(stream)):
        d = sse.SSEDecoder()
        assert [e.data for e in d.feed(stream[:cut]) + d.feed(stream[cut:])] == whole


@pytest.mark.parametrize("route", ["completion", "chat"])
@pytest.mark.parametrize(
    ("fields", "refused"),
    [
        ({"n": 2, "temperature": 0}, True),
        ({"n": 2, "temperature": 0.000001}, True),
        ({"n": 2, "temperature": 0.8, "seed": 1}, False),
        ({"n": 2}, False),  # vLLM's default temperature is 1.0
        ({"n": 1, "temperature": 0}, False),
    ],
)
def test_greedy_n_above_one_is_refused_as_vllm_does(
    card: ModelCard, route: str, fields: dict[str, Any], refused: bool
) -> None:
    make = completion if route == "completion" else chat
    if not refused:
        assert make(card, **fields).gen.n == fields["n"]
        return
    with pytest.raises(HttpError) as info:
        make(card, **fields)
    err = info.value
    assert (err.status, err.type, err.message) == (
        400,
        "BadRequestError",
        "n must be 1 when using greedy sampling, got 2.",
    )


@pytest.mark.parametrize("best_of", [2, 3, 1])
def test_best_of_is_ignored_as_vllm_does(card: ModelCard, best_of: int) -> None:
    # vLLM 0.32's request models have no best_of: an extra field, served without it.
    p = completion(card, best_of=best_of, temperature=0)
    assert p.gen.n == 1 and "best_of" not in p.gen.sampling


def test_error_types_are_vllms(card: ModelCard) -> None:
    with pytest.raises(HttpError) as info:
        completion(card, n=0)
    assert (info.value.status, info.value.type) == (400, "BadRequestError")
    with pytest.raises(HttpError) as info:
        parse_completion(json.dumps({"model": "nope", "prompt": "x"}).encode(), {MODEL: card})
    assert (info.value.status, info.value.type) == (404, "NotFoundError")
    with pytest.raises(HttpError) as info:
        parse_chat(json.dumps({"model": MODEL}).encode(), {MODEL: card})
    assert (info.value.status, info.value.type) == (400, "Bad Request")  # FastAPI's, in vLLM


@pytest.mark.parametrize("include", [False, True])
@pytest.mark.parametrize("stream", [False, True])
def test_a_stop_token_is_counted_and_its_text_left_out_as_vllm_does(
    card: ModelCard, include: bool, stream: bool
) -> None:
    # vLLM's BaseIncrementalDetokenizer.update: a stop-terminated step drops its last
    # token before detokenising unless include_stop_str_in_output.
    gold = ids(card, " gold")
    stop = gold[-1]
    p = completion(card, stop_token_ids=[stop], include_stop_str_in_output=include, stream=stream)
    batches = [TokenBatch(ids(card, "The")), TokenBatch(gold, "stop", stop)]
    if stream:
        relay, chunks = run_relay(p, batches)
        text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
        last = [c for c in chunks if c["choices"]][-1]["choices"][0]
    else:
        relay = Relay(p, created=1)
        for b in batches:
            relay.feed(b)
        last = relay.response()["choices"][0]
        text = last["text"]
    kept = gold if include else gold[:-1]
    assert text == "The" + card.tokenizer.decode(kept) and len(kept) < len(gold) + include
    assert text.endswith(" gold") == include
    assert (last["finish_reason"], last["stop_reason"]) == ("stop", stop)
    assert relay.completion_tokens == len(ids(card, "The")) + len(gold)  # counted either way


UNSERVED = [
    ("logprob_token_ids", [3]),
    ("kv_transfer_params", {"do_remote_prefill": True}),
]


@pytest.mark.parametrize("route", ["completions", "chat"])
@pytest.mark.parametrize(("name", "value"), UNSERVED)
def test_a_parameter_vllm_serves_and_star_does_not_is_refused_not_ignored(
    card: ModelCard, route: str, name: str, value: Any
) -> None:
    parse = completion if route == "completions" else chat
    with pytest.raises(HttpError) as info:
        parse(card, **{name: value})
    err = info.value
    assert (err.status, err.param, err.code) == (400, name, "unsupported_parameter")
    assert "not supported by STAR" in err.message
    # Unset, null or the default: served.
    parse(card, **{name: None})
    default = False
    if not isinstance(value, (dict, list)) or name == "logprob_token_ids":
        parse(card, **{name: default if not isinstance(value, list) else []})


def test_add_special_tokens_is_served_either_way(card: ModelCard) -> None:
    """Each route's default and its opposite (tests/proxy/test_truncation.py: the ids)."""
    for parse in (completion, chat):
        for value in (True, False):
            parse(card, add_special_tokens=value)
    with pytest.raises(HttpError) as info:
        completion(card, add_special_tokens="yes")
    assert info.value.param == "add_special_tokens"


def test_a_request_chat_template_is_refused_as_vllm_does(card: ModelCard) -> None:
    for fields in ({"chat_template": "x"}, {"chat_template_kwargs": {"chat_template": "x"}}):
        with pytest.raises(HttpError) as info:
            chat(card, **fields)
        assert info.value.status == 400
        assert "--trust-request-chat-template is not set" in info.value.message


def test_documents_and_reasoning_effort_reach_the_template_as_vllms(card: ModelCard) -> None:
    template = (
        "{{ reasoning_effort }}|{{ enable_thinking }}|"
        "{% for d in documents or [] %}{{ d.title }};{% endfor %}|{{ messages[0].content }}"
    )
    card = ModelCard(name=MODEL, tokenizer=card.tokenizer, chat_template=template)

    def prompt(**kw: Any) -> str:
        ids = chat(card, **kw).gen.prompt_token_ids
        return str(card.tokenizer.decode(ids, skip_special_tokens=False))

    assert prompt(reasoning_effort="low") == "low|True||hi"
    assert prompt(reasoning_effort="none") == "none|False||hi"
    # The request's own enable_thinking wins; documents go in as given.
    kw = {"chat_template_kwargs": {"enable_thinking": False}, "documents": [{"title": "a"}]}
    assert prompt(reasoning_effort="high", **kw) == "high|False|a;|hi"
    with pytest.raises(HttpError) as info:
        chat(card, reasoning_effort="extreme")
    assert info.value.param == "reasoning_effort"
    with pytest.raises(HttpError):
        chat(card, documents=[{"title": 1}])


def _sse_docs(out: bytes) -> list[dict[str, Any]]:
    return [json.loads(e.data) for e in sse.SSEDecoder().feed(out) if e.data != sse.DONE_DATA]


@pytest.mark.parametrize("echo", [False, True])
def test_return_token_ids_in_a_completion_as_vllm_writes_them(card: ModelCard, echo: bool) -> None:
    """vLLM 0.32's completion server (``return_token_ids``): each choice names its prompt's
    ids (a stream: on the choice's first chunk only) and its generated ids (a stream: each
    chunk its own); with ``echo`` the prompt's text is not echoed (``prompt_text = ""``)."""
    prompts = ["hello", "wörld"]
    outs = [ids(card, " one two"), ids(card, " three")]
    fields = {"prompt": prompts, "n": 1, "max_tokens": 8, "return_token_ids": True, "echo": echo}
    full = Relay(completion(card, **fields))
    for i, tokens in enumerate(outs):
        full.feed(TokenBatch(tokens, "length", index=i))
    for i, choice in enumerate(full.response()["choices"]):
        assert choice["prompt_token_ids"] == ids(card, prompts[i])
        assert choice["token_ids"] == outs[i]
        assert choice["text"] == card.tokenizer.decode(outs[i])  # no echoed prompt
    relay = Relay(completion(card, **fields, stream=True))
    out = b""
    for i, tokens in enumerate(outs):
        for k, t in enumerate(tokens):
            out += relay.feed(TokenBatch([t], "length" if k == len(tokens) - 1 else None, index=i))
    chunks = [c for doc in _sse_docs(out + relay.end()) for c in doc["choices"]]
    for i, tokens in enumerate(outs):
        mine = [c for c in chunks if c["index"] == i]
        assert [c["token_ids"] for c in mine] == [[t] for t in tokens]
        assert [c["prompt_token_ids"] for c in mine] == [ids(card, prompts[i])] + [None] * (
            len(tokens) - 1
        )
        assert "".join(c["text"] for c in mine) == card.tokenizer.decode(tokens)
    # Without it, null as vLLM writes them; and the prompt echoed. A streamed echo names
    # the prompt's ids on its first chunk all the same (vLLM's echo branch; the
    # conformance run found it).
    plain = Relay(completion(card, prompt="hello", max_tokens=8, echo=True))
    plain.feed(TokenBatch(outs[0], "length"))
    (choice,) = plain.response()["choices"]
    assert (choice["prompt_token_ids"], choice["token_ids"]) == (None, None)
    assert choice["text"].startswith("hello")
    for echo in (True, False):
        streamed = Relay(completion(card, prompt="hello", max_tokens=8, echo=echo, stream=True))
        out = b"".join(streamed.feed(TokenBatch([t])) for t in outs[0][:-1])
        out += streamed.feed(TokenBatch(outs[0][-1:], "length")) + streamed.end()
        chunks = [c for doc in _sse_docs(out) for c in doc["choices"]]
        assert [c["prompt_token_ids"] for c in chunks] == [ids(card, "hello") if echo else None] + [
            None
        ] * (len(chunks) - 1)
        assert {str(c["token_ids"]) for c in chunks} == {"None"}


def test_return_tokens_as_token_ids_names_logprob_tokens_by_id(card: ModelCard) -> None:
    relay = Relay(completion(card, logprobs=1, max_tokens=8, return_tokens_as_token_ids=True))
    tokens = ids(card, " one two")
    relay.feed(
        TokenBatch(
            tokens,
            "length",
            logprobs=[-0.5] * len(tokens),
            top_ids=tokens,
            top_logprobs=[-0.5] * len(tokens),
        )
    )
    lp = relay.response()["choices"][0]["logprobs"]
    assert lp["tokens"] == [f"token_id:{t}" for t in tokens]
    assert [list(top) for top in lp["top_logprobs"]] == [[f"token_id:{t}"] for t in tokens]
    # vLLM advances the offsets by the placeholders' lengths
    assert lp["text_offset"] == [
        sum(len(f"token_id:{t}") for t in tokens[:k]) for k in range(len(tokens))
    ]


def test_max_tokens_past_the_context_is_clamped_to_it_as_vllm_does(card: ModelCard) -> None:
    """vLLM 0.32's ``get_max_tokens``: each prompt's budget is what the context leaves of
    it (a batch's prompts each their own); only past ``max_model_len`` itself is a 400."""
    room = card.max_model_len
    (parsed,) = children(completion(card, prompt="hello", max_tokens=room))
    assert parsed.sampling["max_tokens"] == room - len(ids(card, "hello"))
    short, long = [1, 2], [5] * (room - 10)
    batch = completion(card, prompt=[short, long], max_tokens=room - 5, n=2)
    assert [c.sampling["max_tokens"] for c in children(batch)] == [room - 5] * 2 + [10] * 2
    default = children(completion(card, prompt=[short, long]))  # the completions default, 16
    assert [c.sampling["max_tokens"] for c in default] == [16, 10]
    again, _ = request_of(context_of(batch, 1), list(batch.batch), {MODEL: card})
    assert [c.sampling for c in children(again)] == [c.sampling for c in children(batch)]


def test_engine_extras_are_checked_as_vllm_checks_them_and_never_migrate(card: ModelCard) -> None:
    """thinking_token_budget, repetition_detection and vllm_xargs (issue 28): passed on to the
    engine (workers.engine_config), refused with vLLM's checks, the request not migratable."""
    extras = {
        "watermarking": False,
        "thinking_token_budget": 5,
        "repetition_detection": {"max_pattern_size": 4, "min_count": 2},
        "vllm_xargs": {"k": [1, "x"]},
    }
    reasoning = dataclasses.replace(card, reasoning_parser="deepseek_r1")
    for name, value in extras.items():
        gen = completion(reasoning, **{name: value}).gen
        assert name in gen.sampling and not gen.migratable, name
    # Without a reasoning parser vLLM's engine refuses a budget: 400, or in a stream's event.
    with pytest.raises(HttpError) as refused:
        completion(card, thinking_token_budget=5)
    assert "reasoning_config is not configured" in refused.value.message
    with pytest.raises(InStreamError):
        completion(card, thinking_token_budget=5, stream=True)
    unlimited = completion(card, thinking_token_budget=-1).gen
    assert "thinking_token_budget" not in unlimited.sampling and unlimited.migratable
    for name, value in (
        ("thinking_token_budget", -2),
        ("thinking_token_budget", 1.5),
        ("repetition_detection", {"max_pattern_size": 4, "min_count": 1}),
        ("repetition_detection", {"max_pattern_size": 2, "min_pattern_size": 3, "min_count": 2}),
        ("repetition_detection", {"nope": 1}),
        ("vllm_xargs", {"k": {"nested": 1}}),
    ):
        with pytest.raises(HttpError) as info:
            chat(card, **{name: value})
        assert (info.value.status, info.value.param) == (400, name), (name, value)


def test_multimodal_kwargs_are_refused_as_vllm_refuses_them_untrusted(card: ModelCard) -> None:
    """vLLM without --trust-request-mm-kwargs refuses a request's own media_io_kwargs /
    mm_processor_kwargs (the conformance run found it); empty ones change nothing."""
    plain = chat(card).gen
    for name in ("media_io_kwargs", "mm_processor_kwargs"):
        assert chat(card, **{name: {}}).gen.prompt_token_ids == plain.prompt_token_ids
        for value in ({"image": {"x": 1}}, "not an object"):
            with pytest.raises(HttpError) as info:
                chat(card, **{name: value})
            assert info.value.param == name


def test_prompt_embeds_are_refused_as_vllm_refuses_them_without_the_engine_flag(
    card: ModelCard,
) -> None:
    with pytest.raises(HttpError) as info:
        completion(card, prompt_embeds="AAAA")
    assert (info.value.status, info.value.param) == (400, "prompt_embeds")
    assert "--enable-prompt-embeds" in info.value.message


def test_beam_search_is_served_on_completions_as_vllm_checks_it(card: ModelCard) -> None:
    """tests/proxy/test_beam.py runs it; here what is refused: a completion's stream
    (vLLM's answer), echo or logprobs with it and a chat's with tools (not yet in STAR)."""
    parsed = completion(card, use_beam_search=True, n=3, temperature=0, length_penalty=0.5)
    assert parsed.beam is not None and (parsed.beam.width, parsed.beam.length_penalty) == (3, 0.5)
    assert parsed.beam.temperature == 0.0 and completion(card).beam is None
    with pytest.raises(HttpError) as info:
        completion(card, use_beam_search=True, stream=True)
    assert "Streaming is not currently supported with beam search" in info.value.message
    for fields in ({"echo": True}, {"logprobs": 2}):
        with pytest.raises(HttpError) as info:
            completion(card, use_beam_search=True, **fields)
        assert info.value.code == "unsupported_parameter"
    assert chat(card, use_beam_search=True, n=2, stream=True).beam is not None  # vLLM streams it
    # with tools: refused (tests/proxy/test_chat_tools.py, where a card has a tool parser)
