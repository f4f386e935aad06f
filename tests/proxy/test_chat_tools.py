"""Tools and reasoning in chat (proxy.chat_tools) against vLLM's own serving code.

The oracle is vLLM 0.32's ``OpenAIServingChat``: its
``chat_completion_full_generator`` and ``chat_completion_stream_generator``
run on the same generated tokens (as the engine's ``RequestOutput`` objects,
one per step) with the same parser settings, and the proxy's response and
streamed chunks must equal theirs field by field (tool call ids are random on
both sides: compared by shape). The tokenizer is the tiny model's with the
markup tokens of the DeepSeek-R1 and Hermes formats added, as those models
have them.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from benchmarks.conformance import assembled, field_paths
from proxy import chat_tools, sse
from proxy.backend import TokenBatch
from proxy.http import HttpError
from proxy.openai import ParsedRequest, Relay, parse_chat
from proxy.resume import Position, Reader, Tagger, context_of, request_of
from proxy.tokenizer import ModelCard
from star.model import tiny_model_path
from star.model.markup import markup_model

pytestmark = [
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
    pytest.mark.timeout(300),
]

MODEL = "tiny"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "the weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city"],
        },
    },
}
TIME = {
    "type": "function",
    "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}},
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model's tokenizer with <think> and <tool_call> markup as added tokens."""
    return markup_model(tmp_path_factory.mktemp("markup"))


def card_for(model_dir: Path, **parsers: Any) -> ModelCard:
    card = ModelCard.load(model_dir, MODEL)
    card = dataclasses.replace(card, **parsers)
    chat_tools.check(card)
    return card


R1: dict[str, Any] = {"reasoning_parser": "deepseek_r1"}
HERMES: dict[str, Any] = {"tool_call_parser": "hermes", "enable_auto_tool_choice": True}


def encode(card: ModelCard, text: str) -> list[int]:
    return list(card.tokenizer.encode(text, add_special_tokens=False).ids)


def parse(card: ModelCard, **kw: Any) -> ParsedRequest:
    kw.setdefault("messages", [{"role": "user", "content": "hi"}])
    return parse_chat(json.dumps({"model": MODEL, **kw}).encode(), {MODEL: card})


def steps_of(card: ModelCard, text: str, per: int = 1) -> list[list[int]]:
    ids = encode(card, text)
    return [ids[i : i + per] for i in range(0, len(ids), per)]


# -- the proxy ------------------------------------------------------------------------


def with_eos(card: ModelCard, steps: Sequence[list[int]], finish: str) -> list[list[int]]:
    """The engine's steps: a "stop" ends on the EOS token (counted, no text), as vLLM's does."""
    if finish != "stop" or not steps:
        return [list(s) for s in steps]
    eos = card.tokenizer.token_to_id("<|im_end|>")
    return [*(list(s) for s in steps[:-1]), [*steps[-1], eos]]


def star_run(
    parsed: ParsedRequest, steps: Sequence[list[int]], finish: str
) -> dict[str, Any] | list[dict[str, Any]]:
    relay = Relay(parsed, created=1)
    out = b""
    for k, step in enumerate(with_eos(parsed.card, steps, finish)):
        last = k == len(steps) - 1
        out += relay.feed(TokenBatch(list(step), finish if last else None))  # type: ignore[arg-type]
    if not parsed.gen.stream:
        return relay.response()
    out += relay.end()
    events = [e.data for e in sse.SSEDecoder().feed(out)]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


# -- vLLM's server --------------------------------------------------------------------


def vllm_server(card: ModelCard) -> Any:
    """An ``OpenAIServingChat`` holding what its two generators read (no engine)."""
    from vllm.entrypoints.openai.chat_completion.serving import OpenAIServingChat

    server: Any = OpenAIServingChat.__new__(OpenAIServingChat)
    cls = chat_tools.parser_class(card)
    fields = {
        "parser_cls": cls,
        "enable_auto_tools": card.enable_auto_tool_choice,
        "response_role": "assistant",
        "model_config": None,
        "chat_template": None,
        "chat_template_content_format": "auto",
        "default_chat_template_kwargs": {},
        "_include_reasoning_tokens_details": bool(card.reasoning_parser),
        "enable_prompt_tokens_details": False,
        "enable_force_include_usage": False,
        "enable_per_request_metrics": False,
        "enable_log_outputs": False,
        "request_logger": None,
        "system_fingerprint": None,
        "return_tokens_as_token_ids": False,
    }
    for key, value in fields.items():
        object.__setattr__(server, key, value)
    return server


def vllm_request(card: ModelCard, body: dict[str, Any]) -> Any:
    """The request as vLLM's server has it when generating (after ``adjust_request``)."""
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

    request = ChatCompletionRequest.model_validate(
        {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **body}
    )
    cls = chat_tools.parser_class(card)
    if cls is not None and (cls.reasoning_parser_cls is not None or request.tool_choice != "none"):
        request = cls(chat_tools.vllm_tokenizer(card), request.tools).adjust_request(request)
    return request


def vllm_run(
    card: ModelCard,
    body: dict[str, Any],
    prompt: list[int],
    steps: Sequence[list[int]],
    finish: str,
    prompt_text: str | None = None,
) -> dict[str, Any] | list[dict[str, Any]]:
    """vLLM's chat server generators over engine outputs of ``steps`` (``prompt_text``:
    the engine's rendered prompt, ``RequestOutput.prompt``)."""
    from vllm.entrypoints.generate.base.protocol import RequestResponseMetadata
    from vllm.outputs import CompletionOutput, RequestOutput

    server = vllm_server(card)
    request = vllm_request(card, body)
    tok = chat_tools.vllm_tokenizer(card)
    stream = bool(body.get("stream"))
    outputs = []
    done: list[int] = []
    steps = with_eos(card, steps, finish)
    for k, step in enumerate(steps):
        before = tok.decode(done, skip_special_tokens=True)
        done = done + list(step)
        text = tok.decode(done, skip_special_tokens=True)
        last = k == len(steps) - 1
        outputs.append((text[len(before) :], list(step), text, list(done), last))

    def result(delta: str, ids: list[int], text: str, all_ids: list[int], last: bool) -> Any:
        out = CompletionOutput(
            index=0,
            text=delta if stream else text,
            token_ids=ids if stream else all_ids,
            cumulative_logprob=None,
            logprobs=None,
            finish_reason=finish if last else None,
            stop_reason=None,
        )
        return RequestOutput(
            request_id="x",
            prompt=prompt_text,
            prompt_token_ids=prompt,
            prompt_logprobs=None,
            outputs=[out],
            finished=last,
            num_cached_tokens=0,
        )

    async def results() -> Any:
        for item in outputs if stream else outputs[-1:]:
            yield result(*item)

    metadata = RequestResponseMetadata(request_id="x")

    async def run() -> Any:
        if stream:
            chunks = []
            async for event in server.chat_completion_stream_generator(
                request, results(), "x", MODEL, [], tok, metadata
            ):
                chunks.append(event)
            return chunks
        parser = None
        if server.parser_cls is not None:
            parser = server._make_parser(request, tok, {})
        return await server.chat_completion_full_generator(
            request, results(), "x", MODEL, [], tok, metadata, parser=parser
        )

    got = asyncio.run(run())
    if not stream:
        response: dict[str, Any] = json.loads(got.model_dump_json())
        return response
    data = "".join(got)
    events = [e.data for e in sse.SSEDecoder().feed(data.encode())]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def _call_shape(call: dict[str, Any]) -> dict[str, Any]:
    call = dict(call)
    if "id" in call:
        assert isinstance(call["id"], str) and call["id"].startswith("chatcmpl-tool-")
        call["id"] = "ID"
    return call


def message_of(response: Any) -> tuple[dict[str, Any], str]:
    choice = response["choices"][0]
    msg = choice["message"]
    out = {
        "content": msg.get("content"),
        "reasoning": msg.get("reasoning"),
        "tool_calls": [_call_shape(c) for c in msg.get("tool_calls") or []],
    }
    return out, choice["finish_reason"]


def deltas_of(chunks: list[dict[str, Any]]) -> list[tuple[dict[str, Any], Any]]:
    out = []
    for chunk in chunks:
        for choice in chunk["choices"]:
            delta = dict(choice["delta"])
            if "tool_calls" in delta:
                delta["tool_calls"] = [_call_shape(c) for c in delta["tool_calls"]]
            out.append((delta, choice["finish_reason"]))
    return out


# -- the table ------------------------------------------------------------------------

# (parsers, request fields, generated text, tokens per step, finish)
CASES = [
    pytest.param(R1, {}, "<think>a plan, then</think>The answer is 4.", 1, "stop", id="r1"),
    pytest.param(R1, {}, "<think>a plan</think>The answer", 3, "length", id="r1-3-per-step"),
    pytest.param(R1, {}, "no markup at all here", 1, "stop", id="r1-none"),
    pytest.param(R1, {}, "thinking without a start</think>then text", 2, "stop", id="r1-no-start"),
    pytest.param(R1, {}, "<think>cut off in the middle", 1, "length", id="r1-unfinished"),
    pytest.param(
        R1, {"include_reasoning": False}, "<think>hidden</think>shown", 1, "stop", id="r1-hidden"
    ),
    pytest.param(
        HERMES,
        {"tools": [WEATHER]},
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
        1,
        "stop",
        id="hermes-auto-call",
    ),
    pytest.param(
        HERMES, {"tools": [WEATHER]}, "It is sunny in Paris.", 1, "stop", id="hermes-auto-text"
    ),
    pytest.param(
        HERMES,
        {},
        '<tool_call>\n{"name": "get_weather", "arguments": {}}\n</tool_call>',
        1,
        "stop",
        id="hermes-no-tools",
    ),
    pytest.param(
        HERMES,
        {"tools": [WEATHER, TIME]},
        'Let me check.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", '
        '"days": 2}}\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n'
        "</tool_call>",
        2,
        "stop",
        id="hermes-auto-two-calls",
    ),
    pytest.param(
        HERMES,
        {"tools": [WEATHER, TIME], "parallel_tool_calls": False},
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>',
        1,
        "stop",
        id="hermes-auto-not-parallel",
    ),
    pytest.param(
        HERMES,
        {"tools": [WEATHER], "tool_choice": "required"},
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>',
        1,
        "stop",
        id="hermes-required",
    ),
    pytest.param(
        HERMES,
        {
            "tools": [WEATHER, TIME],
            "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
        },
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>',
        1,
        "stop",
        id="hermes-named",
    ),
    pytest.param(
        HERMES,
        {"tools": [WEATHER], "tool_choice": "none"},
        '<tool_call>\n{"name": "get_weather", "arguments": {}}\n</tool_call>',
        1,
        "stop",
        id="hermes-none",
    ),
    pytest.param(
        {**R1, **HERMES},
        {"tools": [WEATHER]},
        '<think>need weather</think><tool_call>\n{"name": "get_weather", "arguments": '
        '{"city": "Lima"}}\n</tool_call>',
        1,
        "stop",
        id="r1-hermes",
    ),
]


@pytest.mark.parametrize("stream", [False, True], ids=["full", "stream"])
@pytest.mark.parametrize(("parsers", "fields", "text", "per", "finish"), CASES)
def test_responses_equal_vllm_servers(
    model_dir: Path,
    parsers: dict[str, Any],
    fields: dict[str, Any],
    text: str,
    per: int,
    finish: str,
    stream: bool,
) -> None:
    card = card_for(model_dir, **parsers)
    body: dict[str, Any] = {**fields, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    parsed = parse(card, **body)
    # A chat without tools under a tool parser alone is plain text (no parser run).
    assert (parsed.chat is None) == (not fields and not card.reasoning_parser)
    # STAR's batches of ``per`` tokens; vLLM's engine steps, one token each (its server
    # parses a step at a time: so does STAR's relay, whatever its batches).
    got = star_run(parsed, steps_of(card, text, per), finish)
    want = vllm_run(card, body, parsed.gen.prompt_token_ids, steps_of(card, text), finish)
    if stream:
        assert isinstance(got, list) and isinstance(want, list)
        assert assembled("chat", got) == assembled("chat", want)
        if per == 1:  # the same batches: the same chunks
            assert deltas_of(got) == deltas_of(want)
        got_usage, want_usage = got[-1]["usage"], want[-1]["usage"]
    else:
        assert message_of(got) == message_of(want)
        got_usage, want_usage = got["usage"], want["usage"]
    # The same usage, reasoning tokens included (vLLM's with a reasoning parser),
    # its unset details null as vLLM writes them; and the same fields throughout.
    assert got_usage == want_usage

    # (This in-process vLLM has no engine config to fingerprint: it writes none,
    # where its server stamps one, as STAR does; the conformance run compares those.)
    def shape(doc: Any) -> Any:
        if isinstance(doc, list):
            return [shape(d) for d in doc]
        return {p for p in field_paths(doc) if p != "system_fingerprint"}

    if stream and per > 1:  # other chunks: the same fields over them
        assert set().union(*shape(got)) == set().union(*shape(want))
    else:
        assert shape(got) == shape(want)
    if card.reasoning_parser:
        assert "completion_tokens_details" in got_usage


def test_streamed_deltas_put_together_equal_the_response(model_dir: Path) -> None:
    card = card_for(model_dir, **R1, **HERMES)
    text = (
        '<think>plan</think>Sure.<tool_call>\n{"name": "get_weather", "arguments": '
        '{"city": "Nice"}}\n</tool_call>'
    )
    full = star_run(parse(card, tools=[WEATHER]), steps_of(card, text), "stop")
    chunks = star_run(parse(card, tools=[WEATHER], stream=True), steps_of(card, text), "stop")
    assert isinstance(full, dict) and isinstance(chunks, list)
    msg = full["choices"][0]["message"]
    assert msg["reasoning"] == "plan"
    assert msg["content"] == "Sure."
    (call,) = msg["tool_calls"]
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Nice"}'}
    assert full["choices"][0]["finish_reason"] == "tool_calls"
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert "".join(d.get("reasoning") or "" for d in deltas) == "plan"
    assert "".join(d.get("content") or "" for d in deltas) == "Sure."
    args = "".join(
        t["function"].get("arguments") or "" for d in deltas for t in d.get("tool_calls", [])
    )
    assert json.loads(args) == {"city": "Nice"}
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_forced_tool_choices_decode_under_structured_outputs(model_dir: Path) -> None:
    card = card_for(model_dir, **HERMES)
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        parsed = parse(
            card, tools=[WEATHER], tool_choice=choice, response_format={"type": "json_object"}
        )
        want = vllm_request(card, {"tools": [WEATHER], "tool_choice": choice}).structured_outputs
        got = parsed.gen.sampling["structured_outputs"]
        assert got == {"structural_tag": want.structural_tag}
        assert "get_weather" in got["structural_tag"]
    auto = parse(card, tools=[WEATHER])
    assert "structured_outputs" not in auto.gen.sampling


ENDED = [
    {"role": "user", "content": "hi"},
    {"role": "assistant", "content": "<think>a plan</think>"},
]


@pytest.mark.parametrize(
    ("parsers", "body", "ended"),
    [
        pytest.param(R1, {}, False, id="r1"),
        pytest.param(R1, {"include_reasoning": False}, True, id="r1-reasoning-not-included"),
        pytest.param(
            R1,
            {"messages": ENDED, "continue_final_message": True, "add_generation_prompt": False},
            True,
            id="r1-the-prompt-ends-the-reasoning",
        ),
        pytest.param(R1, {"chat_template_kwargs": {"enable_thinking": True}}, False, id="r1-kw"),
        pytest.param(
            {**R1, **HERMES}, {"tools": [WEATHER], "tool_choice": "required"}, False, id="r1-tools"
        ),
        pytest.param(HERMES, {"tools": [WEATHER], "tool_choice": "required"}, None, id="hermes"),
        pytest.param({}, {}, None, id="no-parsers"),
    ],
)
def test_the_engine_learns_where_the_reasoning_ends_as_from_vllms_server(
    model_dir: Path, parsers: dict[str, Any], body: dict[str, Any], ended: bool | None
) -> None:
    card = card_for(model_dir, **parsers)
    parsed = parse(card, **body)
    keys = ("reasoning_ended", "reasoning_parser_kwargs")
    got = {k: parsed.gen.sampling[k] for k in keys if k in parsed.gen.sampling}
    # vLLM's server: the kwargs its generate() gets (OpenAIServingChat._engine_reasoning_kwargs).
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

    server = vllm_server(card)
    request = ChatCompletionRequest.model_validate(
        {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **body}
    )
    kwargs = server._effective_chat_template_kwargs(request)
    parser = None
    if server.parser_cls is not None:
        parser = server._make_parser(request, chat_tools.vllm_tokenizer(card), kwargs)
        request = parser.adjust_request(request)
    want = server._engine_reasoning_kwargs(
        request, parser, kwargs, list(parsed.gen.prompt_token_ids)
    )
    if not card.reasoning_parser:
        # Without a reasoning parser the engine has no reasoner: STAR sends nothing.
        assert want["reasoning_parser_kwargs"] is None and want["reasoning_ended"] is ended
        assert got == {}
        return
    assert got == want
    assert got["reasoning_ended"] is ended
    # They do not keep a request from migrating (a true continuation keeps the prompt).
    assert parsed.gen.migratable


# -- resuming a parser stream (proxy.resume) ---------------------------------------------

PARSER_TEXTS = [
    "<think>a plan, then</think>The answer is 4.",
    '<think>need weather</think><tool_call>\n{"name": "get_weather", "arguments": '
    '{"city": "Lima"}}\n</tool_call>',
    'Let me check.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", '
    '"days": 2}}\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n'
    "</tool_call>",
    "no markup at all here",
    "<think>cut off in the middle",
    "thinking without a start</think>then text",
]
PARSERS = {"r1": R1, "hermes": HERMES, "both": {**R1, **HERMES}}


def _parser_events(
    reader: Reader, tokens: list[int], cuts: list[int], finish: str, with_last: bool
) -> list[dict[str, Any]]:
    """A reader's chunks for ``tokens`` batched at ``cuts``; the finish comes with the
    last tokens (``with_last``) or in a batch of its own."""
    bounds = sorted({c % (len(tokens) + 1) for c in cuts} | {0, len(tokens)})
    batches = [TokenBatch(tokens[a:b]) for a, b in itertools.pairwise(bounds)]
    if with_last:
        batches[-1].finish_reason = finish  # type: ignore[assignment]
    else:
        batches.append(TokenBatch([], finish))  # type: ignore[arg-type]
    out = b""
    for batch in batches:
        out += reader.feed(batch)
        if reader.relay.done:
            break
    events = sse.SSEDecoder().feed(out + reader.end())
    assert events[-1].data == sse.DONE_DATA
    return [{**json.loads(e.data), "event_id": e.id} for e in events[:-1]]


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    data=st.data(),
    text=st.sampled_from(PARSER_TEXTS),
    parsers=st.sampled_from(sorted(PARSERS)),
    include_reasoning=st.booleans(),
    finish=st.sampled_from(["stop", "length"]),
    stop=st.sampled_from([[], ["Oslo"], ["e"]]),
)
def test_a_parser_stream_resumes_from_any_event_exactly(
    model_dir: Path, data: Any, text: str, parsers: str, include_reasoning: bool, finish: str,
    stop: list[str],
) -> None:  # fmt: skip
    """A chat through vLLM's reasoning / tool-call parsers, cut after any event and resumed
    on a fresh relay (another proxy's), however either side was batched: the chunks before
    the cut plus the resumed ones put together (reasoning, content, tool calls, finish,
    usage) equal the unbroken stream's, with one role chunk and one finish."""
    card = card_for(model_dir, **PARSERS[parsers])
    body: dict[str, Any] = {
        "stream": True,
        "stream_options": {"include_usage": True},
        "include_reasoning": include_reasoning,
    }
    if card.tool_call_parser:  # tools without one: vLLM's 400 for tool_choice auto
        body["tools"] = [WEATHER, TIME]
    if stop:
        body["stop"] = stop
    parsed = parse(card, **body)
    tokens = encode(card, text)
    if finish == "stop":  # the engine's stop: on EOS, counted, no text
        tokens = with_eos(card, [tokens], "stop")[0]
    tagger = Tagger("k")

    # Another proxy rebuilds the request from the context its worker holds (proxy.adopt).
    elsewhere, created = request_of(
        context_of(parsed, 1), [list(parsed.gen.prompt_token_ids)], {MODEL: card}
    )
    assert created == 1 and elsewhere.chat == parsed.chat and elsewhere.role == parsed.role

    def run(since: Position, with_last: bool, on: ParsedRequest = parsed) -> list[dict[str, Any]]:
        cuts = data.draw(st.lists(st.integers(0, 60), max_size=10))
        return _parser_events(
            Reader(Relay(on, created=1), since, tagger), tokens, cuts, finish, with_last
        )

    whole = _parser_events(
        Reader(Relay(parsed, created=1), Position(), tagger), tokens, [], finish, False
    )
    a = run(Position(), data.draw(st.booleans()))
    # The parser reads one token at a time: the batching does not change what it sends.
    assert assembled("chat", a) == assembled("chat", whole)
    cut = data.draw(st.integers(0, len(a) - 1))  # the last event the client got
    since = tagger.parse(a[cut]["event_id"]).position
    b = run(since, data.draw(st.booleans()), data.draw(st.sampled_from([parsed, elsewhere])))
    joined = a[: cut + 1] + b
    assert assembled("chat", joined) == assembled("chat", whole)
    choices = [c for chunk in joined for c in chunk["choices"]]
    assert sum(1 for c in choices if c.get("finish_reason")) == 1
    assert sum(1 for c in choices if "role" in c.get("delta", {})) == 1
    assert sum(1 for chunk in joined if chunk.get("usage")) == 1


def test_merged_deltas_add_up_as_a_client_adds_them() -> None:
    call = {"index": 0, "id": "x", "type": "function", "function": {"name": "f", "arguments": ""}}
    more = {"index": 0, "function": {"arguments": '{"a"'}}
    second = {"index": 1, "id": "y", "type": "function", "function": {"name": "g"}}
    merged = chat_tools.merge_delta(
        {"reasoning": "a", "tool_calls": [call]},
        {"reasoning": "b", "content": "c", "tool_calls": [more, second]},
    )
    assert merged == {
        "reasoning": "ab",
        "content": "c",
        "tool_calls": [{**call, "function": {"name": "f", "arguments": '{"a"'}}, second],
    }
    assert chat_tools.merge_delta(None, {"content": ""}) == {"content": ""}
    assert chat_tools.merge_delta({"content": "x"}, None) == {"content": "x"}
    assert call["function"] == {"name": "f", "arguments": ""}  # the inputs are left alone


def test_tools_reach_the_chat_template(model_dir: Path) -> None:
    card = card_for(model_dir, **HERMES)
    template = "{% for t in tools %}{{ t.function.name }};{% endfor %}{{ messages[0].content }}"
    card = dataclasses.replace(card, chat_template=template)
    parsed = parse(card, tools=[WEATHER, TIME], tool_choice="none")
    assert card.tokenizer.decode(parsed.gen.prompt_token_ids) == "get_weather;get_time;hi"


@pytest.mark.parametrize(
    ("parsers", "fields", "param", "says"),
    [
        ({}, {"tools": [WEATHER]}, "tool_choice", '"auto" tool choice requires'),
        ({}, {"tools": [WEATHER], "tool_choice": "required"}, "tool_choice", "tool_call_parser"),
        (
            {"tool_call_parser": "hermes"},
            {
                "tools": [WEATHER],
                "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
            },
            "tool_choice",
            'function "get_weather"',
        ),
        (HERMES, {"tool_choice": "required"}, "tool_choice", "`tools` must be set"),
        (
            HERMES,
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice",
            "does not match any",
        ),
        (HERMES, {"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice", "sometimes"),
        (HERMES, {"tools": [{"type": "function"}]}, "tools", ""),
    ],
)
def test_tool_requests_vllm_refuses_are_400s(
    model_dir: Path, parsers: dict[str, Any], fields: dict[str, Any], param: str, says: str
) -> None:
    card = card_for(model_dir, **parsers)
    with pytest.raises(HttpError) as err:
        parse(card, **fields)
    assert err.value.status == 400
    assert says in err.value.message


def test_tool_choice_none_without_parsers_is_plain_text(model_dir: Path) -> None:
    card = card_for(model_dir)
    parsed = parse(card, tools=[WEATHER], tool_choice="none")
    text = '<tool_call>\n{"name": "get_weather", "arguments": {}}\n</tool_call>'
    got = star_run(parsed, steps_of(card, text), "stop")
    assert isinstance(got, dict)
    message = got["choices"][0]["message"]
    assert (message["role"], message["content"]) == ("assistant", text)
    assert "tool_calls" not in message
    assert got["choices"][0]["finish_reason"] == "stop"


@pytest.mark.parametrize(
    ("parsers", "says"),
    [
        ({"reasoning_parser": "no_such_parser"}, "no_such_parser"),
        ({"enable_auto_tool_choice": True}, "needs proxy.tool_call_parser"),
        ({"tool_call_parser": "no_such", "enable_auto_tool_choice": True}, "no_such"),
    ],
)
def test_unknown_parsers_are_refused_at_start(parsers: dict[str, Any], says: str) -> None:
    card = dataclasses.replace(ModelCard.load(tiny_model_path(), MODEL), **parsers)
    with pytest.raises(chat_tools.ParserConfigError, match=says):
        chat_tools.check(card)


def test_a_tokenizer_without_the_markup_is_refused_at_start() -> None:
    card = dataclasses.replace(ModelCard.load(tiny_model_path(), MODEL), **R1)
    with pytest.raises(chat_tools.ParserConfigError, match="think"):
        chat_tools.check(card)


def test_the_proxy_refuses_a_parser_it_cannot_load_at_start(model_dir: Path) -> None:
    from proxy.app import ProxyApp
    from star.settings import ProxySettings
    from tests.proxy.fakes import FakeBackend, Script

    card = ModelCard.load(tiny_model_path(), MODEL)
    backend = FakeBackend(card.tokenizer, Script(text="x"))
    with pytest.raises(chat_tools.ParserConfigError, match="deepseek_r1"):
        ProxyApp(backend, [card], ProxySettings(reasoning_parser="deepseek_r1"))
    good = ModelCard.load(model_dir, MODEL)
    app = ProxyApp(backend, [good], ProxySettings(reasoning_parser="deepseek_r1"))
    assert app.models[MODEL].reasoning_parser == "deepseek_r1"


async def test_a_cut_tool_call_stream_resumes_on_its_proxy_exactly(model_dir: Path) -> None:
    """Over HTTP: a chat with reasoning and a tool call, cut after a few events and resumed
    by ``GET /v1/streams/{last id}``, puts together as the unbroken stream does."""
    import httpx

    from proxy.app import ProxyApp, create_server
    from star.settings import ProxySettings
    from tests.proxy.fakes import FakeBackend, Script
    from tests.proxy.test_resume import _read as events

    card = ModelCard.load(model_dir, MODEL)
    settings_ = ProxySettings(host="127.0.0.1", port=0, drain_timeout_s=2.0, **R1, **HERMES)
    backend = FakeBackend(card.tokenizer, Script(text=PARSER_TEXTS[1], delay_s=0.005))
    app = ProxyApp(backend, [card], settings_)
    server = create_server(app, settings_)
    await server.start()
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "weather?"}],
        "tools": [WEATHER],
        "stream": True,
        "stream_options": {"include_usage": True},
    }

    def chunks(got: list[sse.Event]) -> list[dict[str, Any]]:
        return [json.loads(e.data) for e in got if e.data != sse.DONE_DATA]

    try:
        async with httpx.AsyncClient(
            base_url=f"http://127.0.0.1:{server.port}",
            headers={"accept": "text/event-stream"},
            timeout=30,
        ) as c:
            async with c.stream("POST", "/v1/chat/completions", json=body) as resp:
                whole = await events(resp)
            async with c.stream("POST", "/v1/chat/completions", json=body) as resp:
                first = await events(resp, 6)  # then the client is cut
            async with c.stream("GET", f"/v1/streams/{first[-1].id}") as resp:
                assert resp.status_code == 200
                rest = await events(resp)
    finally:
        await server.shutdown(timeout_s=1.0)
        app.close()
    assert rest[-1].data == sse.DONE_DATA
    joined = assembled("chat", chunks(first + rest))
    assert joined == assembled("chat", chunks(whole))
    choice = joined["choices"]["0"]
    assert choice["reasoning"] == "need weather" and choice["finish_reason"] == "tool_calls"
    (call,) = choice["tool_calls"]
    assert call["name"] == "get_weather" and json.loads(call["arguments"]) == {"city": "Lima"}
    # One generation: the resume read what the held stream decoded.
    assert [call.outcome for call in backend.calls] == ["finished", "finished"]


def _ids_of(doc: dict[str, Any] | list[dict[str, Any]]) -> tuple[Any, list[Any]]:
    """A response's prompt token ids and each choice's token ids (a stream's joined,
    and each chunk's, in order)."""
    if isinstance(doc, dict):
        return doc["prompt_token_ids"], [doc["choices"][0]["token_ids"]]
    prompts = [c["prompt_token_ids"] for c in doc if c.get("prompt_token_ids") is not None]
    chunks = [ch.get("token_ids") for c in doc for ch in c["choices"]]
    return prompts, chunks


@pytest.mark.parametrize("per", [1, 3])
@pytest.mark.parametrize("stream", [False, True], ids=["full", "stream"])
@pytest.mark.parametrize(
    ("parsers", "fields", "text"),
    [
        pytest.param({}, {}, "plain text, no parser", id="plain"),
        pytest.param(R1, {}, "<think>a plan, then</think>The answer is 4.", id="r1"),
        pytest.param(R1, {"include_reasoning": False}, "<think>hidden</think>shown", id="hidden"),
        pytest.param(
            HERMES,
            {"tools": [WEATHER]},
            '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
            id="hermes",
        ),
    ],
)
def test_return_token_ids_as_vllms_server(
    model_dir: Path,
    parsers: dict[str, Any],
    fields: dict[str, Any],
    text: str,
    stream: bool,
    per: int,
) -> None:
    """``return_token_ids`` (issue 28): the prompt's ids on the first chunk (the response),
    each chunk's tokens' ids, none where vLLM hides a parser's metadata; one engine step a
    batch gives vLLM's chunks, larger batches the same ids joined."""
    card = card_for(model_dir, **parsers)
    body: dict[str, Any] = {**fields, "stream": stream, "return_token_ids": True}
    parsed = parse(card, **body)
    got = star_run(parsed, steps_of(card, text, per), "stop")
    want = vllm_run(card, body, parsed.gen.prompt_token_ids, steps_of(card, text), "stop")
    (got_prompt, got_ids), (want_prompt, want_ids) = _ids_of(got), _ids_of(want)
    assert got_prompt == want_prompt and want_prompt
    if per == 1 or not stream:
        assert got_ids == want_ids
    else:
        joined = [t for ids in got_ids if ids for t in ids]
        assert joined == [t for ids in want_ids if ids for t in ids]
        assert (None in got_ids) == (None in want_ids)
    if stream:
        assert assembled("chat", got) == assembled("chat", want)  # type: ignore[arg-type]


@pytest.mark.parametrize("stream", [False, True], ids=["full", "stream"])
def test_return_prompt_text_as_vllms_server(model_dir: Path, stream: bool) -> None:
    """``return_prompt_text`` (issue 28): the rendered prompt on the response (streamed: on
    the role chunk), null without it."""
    card = card_for(model_dir)
    for asked in (True, False):
        body: dict[str, Any] = {"stream": stream, "return_prompt_text": asked}
        parsed = parse(card, **body)
        rendered = card.render_chat([{"role": "user", "content": "hi"}])
        got = star_run(parsed, steps_of(card, "plain"), "stop")
        want = vllm_run(
            card, body, parsed.gen.prompt_token_ids, steps_of(card, "plain"), "stop", rendered
        )
        texts = [d.get("prompt_text") for d in (got if isinstance(got, list) else [got])]
        assert texts == [d.get("prompt_text") for d in (want if isinstance(want, list) else [want])]
        assert (rendered in texts) == asked


def test_beam_search_with_tools_is_refused_for_now(model_dir: Path) -> None:
    """vLLM parses a beam's text with its tool parser; STAR does not yet (a 400 naming it)."""
    card = card_for(model_dir, **HERMES)
    with pytest.raises(HttpError) as info:
        parse(card, tools=[WEATHER], use_beam_search=True, n=2)
    assert (info.value.param, info.value.code) == ("use_beam_search", "unsupported_parameter")
    assert parse(card, use_beam_search=True, n=2).beam is not None  # no tools: served
