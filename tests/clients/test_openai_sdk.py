"""Tools through the openai SDK on a real fleet: sync, async and streamed (issue 28 item 5).

The tiny model cannot decide to call a tool: with ``tool_choice`` ``auto`` it
writes text. A named function and ``required`` are decoded under the
structured outputs vLLM's parser builds from the tools, so the grammar makes
the call whatever the model; the arguments' values are the model's (greedy),
held to an enum so the call ends. ``required`` with ``parallel_tool_calls``
left on lets the model add calls until ``max_tokens`` (the tiny model does):
these tests ask for one call. What is checked is STAR's part: the call
parsed by vLLM's parser into ``tool_calls`` in vLLM's shapes, the stream's
deltas adding up to the same call, sync, async and streamed equal (greedy),
a tool result sent back, and a call that ended on its own (not cut by
``max_tokens``).
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import openai
import pytest

from star.fleet import LocalCluster
from tests.clients.conftest import MODEL

pytestmark = [pytest.mark.engine, pytest.mark.timeout(900)]

CITIES = ["Paris", "Rome", "Oslo"]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "the weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "enum": CITIES}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "the time in a time zone",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
TOOLS: Any = [WEATHER, TIME]
MESSAGES: Any = [{"role": "user", "content": "what is the weather in Paris?"}]
NAMED: Any = {"type": "function", "function": {"name": "get_weather"}}
MAX_TOKENS = 100
# The call of each choice: the request's fields and the finish_reason vLLM gives.
CHOICES = {
    "named": ({"tool_choice": NAMED}, "stop"),
    "required": ({"tool_choice": "required", "parallel_tool_calls": False}, "tool_calls"),
}


def sdk(fleet: LocalCluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{fleet.url}/v1", api_key="unused", max_retries=0, timeout=300)


def async_sdk(fleet: LocalCluster) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(
        base_url=f"{fleet.url}/v1", api_key="unused", max_retries=0, timeout=300
    )


def request(kind: str) -> dict[str, Any]:
    fields, _ = CHOICES[kind]
    return {
        "model": MODEL,
        "messages": MESSAGES,
        "tools": TOOLS,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        **fields,
    }


def check_call(name: str, arguments: str) -> None:
    """A call of one of TOOLS whose arguments are its schema's (the grammar held them)."""
    args = json.loads(arguments)
    if name == "get_weather":
        assert set(args) == {"city"} and args["city"] in CITIES, args
    else:
        assert name == "get_time", name
        assert set(args) == {"zone"} and args["zone"] in ("UTC", "CET"), args


def parsed(calls: list[tuple[str, str]]) -> list[tuple[str, Any]]:
    return [(name, json.loads(arguments)) for name, arguments in calls]


def calls_of(message: Any) -> list[tuple[str, str]]:
    return [(c.function.name, c.function.arguments) for c in message.tool_calls or []]


@pytest.mark.parametrize("kind", sorted(CHOICES))
def test_sync_and_async_tool_calls(fleet: LocalCluster, kind: str) -> None:
    resp = sdk(fleet).chat.completions.create(**request(kind))
    (choice,) = resp.choices
    assert choice.finish_reason == CHOICES[kind][1], choice
    assert choice.message.role == "assistant"
    assert choice.message.content == ""  # vLLM's forced call: no text around it
    (call,) = choice.message.tool_calls or []
    assert call.type == "function" and call.id.startswith("chatcmpl-tool-"), call
    check_call(call.function.name, call.function.arguments)
    if kind == "named":
        assert call.function.name == "get_weather"
    # It ended on its own: the grammar's end, not max_tokens.
    assert resp.usage is not None and resp.usage.completion_tokens < MAX_TOKENS

    async def async_call() -> Any:
        client = async_sdk(fleet)
        try:
            return await client.chat.completions.create(**request(kind))
        finally:
            await client.close()

    again = asyncio.run(async_call())
    assert calls_of(again.choices[0].message) == calls_of(choice.message)
    assert again.choices[0].finish_reason == choice.finish_reason
    assert again.usage == resp.usage


def assemble(chunks: list[Any]) -> tuple[dict[int, dict[str, Any]], str, str | None]:
    """The calls, the text and the finish_reason a streamed choice's deltas add up to."""
    calls: dict[int, dict[str, Any]] = {}
    text = ""
    finish = None
    for chunk in chunks:
        for choice in chunk.choices:
            assert choice.index == 0
            text += choice.delta.content or ""
            for d in choice.delta.tool_calls or []:
                call = calls.setdefault(d.index, {"id": None, "name": "", "arguments": ""})
                if d.id:
                    assert call["id"] is None, "a call's id comes once"
                    call["id"] = d.id
                if d.function is not None:
                    call["name"] += d.function.name or ""
                    call["arguments"] += d.function.arguments or ""
            finish = choice.finish_reason or finish
    return calls, text, finish


@pytest.mark.parametrize("kind", sorted(CHOICES))
def test_streamed_tool_calls_add_up_to_the_call(fleet: LocalCluster, kind: str) -> None:
    whole = sdk(fleet).chat.completions.create(**request(kind))
    want = calls_of(whole.choices[0].message)
    body = {**request(kind), "stream": True, "stream_options": {"include_usage": True}}
    chunks = list(sdk(fleet).chat.completions.create(**body))
    assert chunks[0].choices[0].delta.role == "assistant"
    calls, text, finish = assemble(chunks[:-1])
    # The same call. Its arguments' text too for a named choice; for a required one
    # vLLM streams the text the model wrote and answers json.dumps of it (a space
    # after each ':' and ',', which the compact grammar leaves out).
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == parsed(want)
    if kind == "named":
        assert [(c["name"], c["arguments"]) for c in calls.values()] == want
    assert all(c["id"] and c["id"].startswith("chatcmpl-tool-") for c in calls.values())
    assert text == ""
    assert finish == CHOICES[kind][1]
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage

    async def async_stream() -> list[Any]:
        client = async_sdk(fleet)
        try:
            return [c async for c in await client.chat.completions.create(**body)]
        finally:
            await client.close()

    again = asyncio.run(async_stream())
    calls_again, _, finish_again = assemble(again[:-1])
    assert [(c["name"], c["arguments"]) for c in calls_again.values()] == [
        (c["name"], c["arguments"]) for c in calls.values()
    ]
    assert finish_again == finish


def test_auto_on_the_tiny_model_is_text_and_a_tool_result_goes_back(fleet: LocalCluster) -> None:
    """``auto`` leaves the choice to the model: the tiny one writes text (no ``<tool_call>``).

    A conversation carrying a call and its result (an assistant message with
    ``tool_calls`` and no content, a ``tool`` message) is rendered and
    answered: what an agent's second turn sends.
    """
    c = sdk(fleet)
    auto = c.chat.completions.create(
        model=MODEL, messages=MESSAGES, tools=TOOLS, max_tokens=24, temperature=0
    )
    plain = c.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=24, temperature=0)
    assert auto.choices[0].message.tool_calls in (None, [])
    assert auto.choices[0].message.content  # text; the template ignores tools=
    assert auto.choices[0].message.content == plain.choices[0].message.content

    first = c.chat.completions.create(**request("named"))
    (call,) = first.choices[0].message.tool_calls or []
    messages: Any = [
        *MESSAGES,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {"name": call.function.name, "arguments": call.function.arguments},
                }
            ],
        },
        {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"},
    ]
    answer = c.chat.completions.create(
        model=MODEL,
        messages=messages,
        tools=TOOLS,
        tool_choice="none",
        max_tokens=24,
        temperature=0,
    )
    assert answer.choices[0].message.tool_calls in (None, [])
    assert answer.choices[0].message.content
    assert answer.choices[0].finish_reason in ("stop", "length")
