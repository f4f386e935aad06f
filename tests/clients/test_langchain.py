"""LangChain's ChatOpenAI (``langchain-openai``) and a LangChain agent against a real fleet.

Issue 28 item 5 and its "done when": ``bind_tools`` gets a parsed tool call,
``with_structured_output`` a parsed object, and a LangChain agent
(``langchain.agents.create_agent``) calls a tool through STAR while the
request that makes the call is migrated from one decode instance to the
other, the call equal to an unmigrated run's (greedy).

The tiny model cannot choose to call a tool (``auto`` gives text), so every
call here is forced: a named function (``tool_choice`` the tool's name) or
``any`` (OpenAI's ``required``), with ``strict`` tools (their arguments an
enum, ``additionalProperties`` false) so that the grammar ends the call. The
agent's middleware forces its first model call to the tool and its second,
after the tool's result, to text (``tool_choice`` ``none``).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from typing import Any, Literal

import pytest
from langchain.agents import create_agent
from langchain.agents.middleware import ModelRequest, ModelResponse, wrap_model_call
from langchain_core.messages import AIMessage, AIMessageChunk, BaseMessage, ToolMessage
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from pydantic import BaseModel

from star.bus import Bus
from star.fleet import LocalCluster, manual_decision
from star.wire import Event, EventKind, decode
from tests.clients.conftest import DECODE, MODEL
from tests.migration.conftest import wait_event

pytestmark = [pytest.mark.engine, pytest.mark.timeout(900)]

CITIES = ("Paris", "Rome", "Oslo")
QUESTION = "what is the weather in Paris?"
MAX_TOKENS = 100
SETTLED = (EventKind.RELEASED, EventKind.REFUSED)  # a decision's outcome at the source
FORECAST = {"Paris": "sunny, 21 C", "Rome": "clear, 25 C", "Oslo": "rain, 9 C"}


@tool
def get_weather(city: Literal["Paris", "Rome", "Oslo"]) -> str:
    """The weather in a city."""
    return FORECAST[city]


@tool
def get_time(zone: Literal["UTC", "CET"]) -> str:
    """The time in a time zone."""
    return "12:00" if zone == "UTC" else "13:00"


class Weather(BaseModel):
    """A weather report."""

    city: Literal["Paris", "Rome", "Oslo"]
    sky: Literal["sunny", "cloudy", "rain"]


def chat_model(fleet: LocalCluster, **kw: Any) -> ChatOpenAI:
    return ChatOpenAI(
        model=MODEL,
        base_url=f"{fleet.url}/v1",
        api_key="unused",  # type: ignore[arg-type]
        temperature=0,
        max_tokens=MAX_TOKENS,  # type: ignore[call-arg]
        max_retries=0,
        timeout=300,
        **kw,
    )


def check_call(call: dict[str, Any]) -> None:
    if call["name"] == "get_weather":
        assert set(call["args"]) == {"city"} and call["args"]["city"] in CITIES, call
    else:
        assert call["name"] == "get_time", call
        assert set(call["args"]) == {"zone"} and call["args"]["zone"] in ("UTC", "CET"), call


def test_bind_tools_named_and_any(fleet: LocalCluster) -> None:
    llm = chat_model(fleet)
    named = llm.bind_tools([get_weather, get_time], tool_choice="get_weather", strict=True)
    msg = named.invoke(QUESTION)
    assert isinstance(msg, AIMessage)
    (call,) = msg.tool_calls
    assert call["name"] == "get_weather" and call["type"] == "tool_call"
    assert call["id"] and call["id"].startswith("chatcmpl-tool-")
    check_call(dict(call))
    assert not msg.invalid_tool_calls
    assert msg.response_metadata["finish_reason"] == "stop"  # vLLM's, for a named call
    assert msg.usage_metadata is not None and msg.usage_metadata["output_tokens"] < MAX_TOKENS

    any_ = llm.bind_tools(
        [get_weather, get_time], tool_choice="any", strict=True, parallel_tool_calls=False
    )
    msg = any_.invoke(QUESTION)
    assert isinstance(msg, AIMessage)
    (call,) = msg.tool_calls
    check_call(dict(call))
    assert msg.response_metadata["finish_reason"] == "tool_calls"

    # Streamed (LangChain's tool_call_chunks) and async: the same call, greedy.
    chunks = list(named.stream(QUESTION))
    total = chunks[0]
    for c in chunks[1:]:
        total = total + c
    assert isinstance(total, AIMessageChunk)
    ref = named.invoke(QUESTION)
    assert [(c["name"], c["args"]) for c in total.tool_calls] == [
        (c["name"], c["args"]) for c in ref.tool_calls
    ]
    again = asyncio.run(named.ainvoke(QUESTION))
    assert isinstance(again, AIMessage)
    assert [(c["name"], c["args"]) for c in again.tool_calls] == [
        (c["name"], c["args"]) for c in ref.tool_calls
    ]


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_with_structured_output_returns_the_object(fleet: LocalCluster, method: str) -> None:
    """``json_schema``: STAR's structured outputs (``response_format``); ``function_calling``:
    a named tool call, parsed by LangChain into the object."""
    structured = chat_model(fleet).with_structured_output(
        Weather, method=method, strict=True, include_raw=True
    )
    out = structured.invoke("the weather in Rome, as a report")
    assert isinstance(out, dict) and out["parsing_error"] is None, out
    report = out["parsed"]
    assert isinstance(report, Weather), out
    assert report.city in CITIES
    raw = out["raw"]
    assert isinstance(raw, AIMessage)
    assert raw.usage_metadata is not None and raw.usage_metadata["output_tokens"] < MAX_TOKENS
    if method == "function_calling":
        (call,) = raw.tool_calls
        assert call["name"] == "Weather" and call["args"] == report.model_dump()
    else:
        assert Weather.model_validate_json(str(raw.content)) == report


@wrap_model_call
def call_the_tool_first(
    request: ModelRequest, handler: Callable[[ModelRequest], ModelResponse]
) -> ModelResponse:
    """The first model call must call get_weather; once a result is in, the model writes text."""
    called = any(isinstance(m, ToolMessage) for m in request.messages)
    return handler(
        request.override(
            tool_choice="none" if called else "get_weather",
            model_settings={**request.model_settings, "strict": True},
        )
    )


def run_agent(fleet: LocalCluster) -> list[BaseMessage]:
    agent = create_agent(chat_model(fleet), tools=[get_weather], middleware=[call_the_tool_first])
    out = agent.invoke({"messages": [{"role": "user", "content": QUESTION}]})
    return list(out["messages"])


def transcript(messages: list[BaseMessage]) -> list[tuple[str, Any]]:
    """What an agent's run said, without the random ids: who, and the call or the text."""
    out: list[tuple[str, Any]] = []
    for m in messages:
        if isinstance(m, AIMessage) and m.tool_calls:
            out.append(("call", [(c["name"], c["args"]) for c in m.tool_calls]))
        else:
            out.append((m.type, m.content))
    return out


async def new_chat_request(bus: Bus, seen: set[str], within_s: float = 120.0) -> tuple[str, str]:
    """The first chat request dispatched that is not in ``seen``: its id and its instance."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        for _i, raw in await bus.tail("events", 2000):
            e = decode(raw[b"body"])
            if (
                isinstance(e, Event)
                and e.event is EventKind.DISPATCHED
                and e.request.startswith("chatcmpl-")
                and e.request not in seen
            ):
                return e.request, e.instance
        await asyncio.sleep(0.05)
    raise AssertionError(f"no new chat request dispatched within {within_s} s")


async def migrate_while_decoding(bus: Bus, rid: str, source: str, target: str) -> None:
    """Move ``rid`` from ``source`` to ``target``: decided again while the proxy or the source
    worker says "not decoding yet" (the proxy's dispatched event comes before its leg to
    ``source`` is open; the worker's engine has given no token yet), until the source
    releases it. A proxy's "release sent" is not the answer: the worker's is."""
    for _ in range(400):
        await bus.publish("decisions", d := manual_decision(rid, source, target))
        acted = await wait_event(
            bus,
            rid,
            lambda e: e.migration == d.id and e.event in SETTLED,
            "released or refused",
            120,
        )
        if acted.event is EventKind.RELEASED:
            return
        assert acted.detail == "not decoding yet", acted
        await asyncio.sleep(0.02)
    raise AssertionError(f"{rid} not decoding on {source} after 400 decisions")


async def test_an_agent_calls_a_tool_while_its_request_is_migrated(
    fleet: LocalCluster, bus: Bus
) -> None:
    """The done-when of issue 28: the request that makes the agent's tool call is moved to the
    other decode instance as soon as its source decodes (by recompute: a few tokens
    generated; the fleet's decode steps are padded to 50 ms, so the dozen-token call lasts
    long enough to be moved), and the call, the tool's result and the agent's answer equal
    an unmigrated run's."""
    ref = await asyncio.to_thread(run_agent, fleet)
    said = transcript(ref)
    assert [who for who, _ in said] == ["human", "call", "tool", "ai"], said
    assert said[1][1] == [("get_weather", {"city": said[1][1][0][1]["city"]})]
    assert said[2][1] == FORECAST[said[1][1][0][1]["city"]]
    assert said[3][1]  # the model's text after the result

    seen = {
        e.request
        for _i, raw in await bus.tail("events", 20_000)
        if isinstance(e := decode(raw[b"body"]), Event)
    }
    run: asyncio.Task[list[BaseMessage]] | None = None
    try:
        run = asyncio.create_task(asyncio.to_thread(run_agent, fleet))
        rid, source = await new_chat_request(bus, seen)
        target = DECODE[1] if source == DECODE[0] else DECODE[0]
        await migrate_while_decoding(bus, rid, source, target)
        got = await run
    finally:
        if run is not None and not run.done():  # engines run again: it ends
            with contextlib.suppress(Exception):
                await asyncio.wait_for(run, 300)
    await wait_event(bus, rid, lambda e: e.event is EventKind.FINISHED, "finished", 120)
    evs = await bus.request_events(rid)
    assert {e.detail for e in evs if e.event is EventKind.REFUSED} <= {"not decoding yet"}
    # Each decision sent a Release; the worker refused them until its engine decoded.
    assert {e.instance for e in evs if e.event is EventKind.MIGRATING} == {source}
    assert len([e for e in evs if e.event is EventKind.RELEASED]) == 1
    assert [e.instance for e in evs if e.event is EventKind.RESUMED] == [target], [
        (e.event.value, e.detail, e.instance) for e in evs
    ]
    finished = [e for e in evs if e.event is EventKind.FINISHED]
    assert finished and finished[-1].data["migrations"] == 1
    assert finished[-1].instance == target
    assert transcript(got) == said
