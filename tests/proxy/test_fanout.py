"""n > 1, batched prompts and echo: the fan-out into children and the merge back.

The children's table (seeds, prompts, ids), the merged stream under any
interleaving (hypothesis), and the whole front end through the openai SDK
against a fake backend: indices, usage, echo, streaming order, one choice cut
by a stop string, a failing child, a client that goes away.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import openai
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from proxy import parsing
from proxy.backend import BackendError, GenerationRequest, TokenBatch
from proxy.fanout import FanIn, children
from proxy.openai import ParsedRequest, Relay, parse_chat, parse_completion
from proxy.tokenizer import ModelCard
from tests.proxy.conftest import Proxy, ProxyFactory
from tests.proxy.fakes import Script
from tests.proxy.rawhttp import exchange, parse_responses, request_bytes, until

MODEL = "tiny"


def completion(card: ModelCard, **kw: Any) -> ParsedRequest:
    body = json.dumps({"model": MODEL, "prompt": kw.pop("prompt", "hello"), **kw}).encode()
    return parse_completion(body, {MODEL: card})


def client(proxy: Proxy) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=proxy.base_url, api_key="none", max_retries=0, timeout=60)


# -- the children -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fields", "prompts", "seeds", "migratable"),
    [
        # n > 1: one prompt, n children; a seed s gives child i the seed s + i (vLLM 0.32)
        ({"n": 3}, [0, 0, 0], [None, None, None], [True] * 3),
        ({"n": 3, "seed": 5}, [0, 0, 0], [5, 6, 7], [True] * 3),
        ({"n": 2, "seed": -1}, [0, 0], [-1, 0], [True] * 2),
        # a batch: choice k is prompt k // n, each prompt's children seeded alike
        ({"prompt": ["a", "b"]}, [0, 1], [None, None], [True] * 2),
        ({"prompt": ["a", "b"], "seed": 9}, [0, 1], [9, 9], [True] * 2),
        ({"prompt": [[5, 6], [7]], "n": 2, "seed": 7}, [0, 0, 1, 1], [7, 8, 7, 8], [True] * 4),
        ({"prompt": ["a", "b", "c"], "n": 2}, [0, 0, 1, 1, 2, 2], [None] * 6, [True] * 6),
    ],
)
def test_children_table(
    card: ModelCard,
    fields: dict[str, Any],
    prompts: list[int],
    seeds: list[int | None],
    migratable: list[bool],
) -> None:
    p = completion(card, temperature=0.7, **fields)
    kids = children(p)
    assert len(kids) == p.num_choices == len(prompts)
    assert [k.request_id for k in kids] == [f"{p.gen.request_id}-{i}" for i in range(len(kids))]
    assert [k.prompt_token_ids for k in kids] == [p.batch[i] for i in prompts]
    assert [k.sampling.get("seed") for k in kids] == seeds
    assert [k.migratable for k in kids] == migratable
    for kid in kids:
        assert kid.n == 1 and "n" not in kid.sampling
        assert kid.sampling["temperature"] == 0.7
        assert (kid.kind, kid.stream, kid.max_tokens) == (
            p.gen.kind,
            p.gen.stream,
            p.gen.max_tokens,
        )


def test_one_choice_is_its_own_child(card: ModelCard) -> None:
    for p in (completion(card), completion(card, prompt=["only"]), completion(card, prompt=[[3]])):
        assert children(p) == [p.gen]
    chat = parse_chat(
        json.dumps(
            {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "n": 2}
        ).encode(),
        {MODEL: card},
    )
    assert [k.prompt_token_ids for k in children(chat)] == [chat.gen.prompt_token_ids] * 2


@pytest.mark.parametrize(
    ("prompt", "echo"),
    [
        ("Say hi", ("Say hi",)),
        (["one", "two"], ("one", "two")),
        # token ids come back decoded, special tokens included (vLLM's renderer)
        ([[0, 260, 261]], None),
        ([[260], [261, 1]], None),
    ],
)
def test_echo_texts(card: ModelCard, prompt: Any, echo: tuple[str, ...] | None) -> None:
    p = completion(card, prompt=prompt, echo=True)
    if echo is None:
        echo = tuple(card.tokenizer.decode(ids, skip_special_tokens=False) for ids in prompt)
    assert p.echo == echo
    assert completion(card, prompt=prompt).echo == ()


async def test_a_parse_worker_returns_the_batch_and_echo(card: ModelCard) -> None:
    models = {MODEL: card}
    body = json.dumps(
        {"model": MODEL, "prompt": [[3, 4], [5, 6, 7]], "n": 2, "echo": True, "max_tokens": 4}
    ).encode()
    there = await parsing.Parsing(models, inline_bytes=0).parse(parse_completion, body)
    here = parse_completion(body, models)
    assert (there.prompts, there.echo) == (here.prompts, here.echo)
    assert there.prompts == ([3, 4], [5, 6, 7]) and there.num_choices == 4
    assert there.echo == (card.tokenizer.decode([3, 4], skip_special_tokens=False), here.echo[1])


def test_relay_indices_usage_and_echo(card: ModelCard) -> None:
    """Non-streaming: choice k = prompt k // n, the prompt echoed in front, usage once per prompt."""
    p = completion(card, prompt=["ab", "hello world"], n=2, echo=True, max_tokens=50)
    relay = Relay(p, created=1)
    eos = card.tokenizer.token_to_id("<|im_end|>")
    for k in (3, 0, 2, 1):  # any order of arrival
        ids = card.tokenizer.encode(f" c{k}").ids
        # choice 0 stops on the EOS token (counted, its text left out, as in vLLM)
        relay.feed(TokenBatch(ids if k else [*ids, eos], "length" if k else "stop", None, k))
    resp = relay.response()
    assert [c["index"] for c in resp["choices"]] == [0, 1, 2, 3]
    prompts = ["ab", "ab", "hello world", "hello world"]
    assert [c["text"] for c in resp["choices"]] == [f"{prompts[k]} c{k}" for k in range(4)]
    assert [c["finish_reason"] for c in resp["choices"]] == ["stop", "length", "length", "length"]
    completion_tokens = 1 + sum(len(card.tokenizer.encode(f" c{k}").ids) for k in range(4))
    assert resp["usage"] == {
        "prompt_tokens": len(p.batch[0]) + len(p.batch[1]),
        "completion_tokens": completion_tokens,
        "total_tokens": len(p.batch[0]) + len(p.batch[1]) + completion_tokens,
        "prompt_tokens_details": None,  # vLLM's placeholders
        "completion_tokens_details": None,
    }


def test_streamed_echo_rides_on_each_choices_first_chunk(card: ModelCard) -> None:
    p = completion(card, prompt="Say", n=2, echo=True, stream=True, max_tokens=50)
    relay = Relay(p, created=1)
    chunks = []
    for batch in (
        TokenBatch(card.tokenizer.encode(" a").ids, None, None, 1),
        TokenBatch(card.tokenizer.encode(" b").ids, None, None, 1),
        TokenBatch([], "stop", None, 0),  # choice 0's first and last batch: no new text
        TokenBatch([], "stop", None, 1),
    ):
        chunks += [
            json.loads(line[6:]) for line in relay.feed(batch).decode().split("\n\n") if line
        ]
    chunks += [json.loads(line[6:]) for line in relay.end().decode().split("\n\n")[:-2]]
    got = [
        (c["choices"][0]["index"], c["choices"][0]["text"], c["choices"][0]["finish_reason"])
        for c in chunks
    ]
    assert got == [(1, "Say a", None), (1, " b", None), (0, "Say", "stop"), (1, "", "stop")]


# -- the merge ---------------------------------------------------------------------------


async def _child(tokens: list[list[int]], yields: list[int]) -> AsyncIterator[TokenBatch]:
    for i, ids in enumerate(tokens):
        for _ in range(yields[i % len(yields)]):
            await asyncio.sleep(0)
        yield TokenBatch(ids, "length" if i == len(tokens) - 1 else None)


@settings(max_examples=60, derandomize=True)
@given(
    st.lists(
        st.tuples(
            st.lists(st.lists(st.integers(0, 99), max_size=3), min_size=1, max_size=6),
            st.lists(st.integers(0, 3), min_size=1, max_size=4),
        ),
        min_size=1,
        max_size=5,
    )
)
def test_fan_in_delivers_each_childs_batches_in_order_under_any_interleaving(
    kids: list[tuple[list[list[int]], list[int]]],
) -> None:
    async def run() -> dict[int, list[list[int]]]:
        got: dict[int, list[list[int]]] = {}
        async for batch in FanIn([_child(tokens, yields) for tokens, yields in kids]):
            got.setdefault(batch.index, []).append(batch.token_ids)
        return got

    got = asyncio.run(run())
    assert got == {k: tokens for k, (tokens, _) in enumerate(kids)}


async def test_fan_in_failure_and_close_end_every_child() -> None:
    ended: list[str] = []

    async def child(name: str, fail: bool) -> AsyncIterator[TokenBatch]:
        try:
            yield TokenBatch([1])
            if fail:
                raise BackendError("child failed")
            await asyncio.Event().wait()
        except BaseException as exc:
            # cancelled mid-await or closed at its yield: either way it aborts upstream
            kind = (
                "stopped" if isinstance(exc, asyncio.CancelledError | GeneratorExit) else "failed"
            )
            ended.append(f"{name}:{kind}")
            raise

    merged = FanIn([child("a", False), child("b", True), child("c", False)])
    with pytest.raises(BackendError, match="child failed"):
        async for _ in merged:
            pass
    await merged.aclose()
    assert sorted(ended) == ["a:stopped", "b:failed", "c:stopped"]

    ended.clear()
    merged = FanIn([child("a", False), child("b", False)])
    await anext(merged)
    await merged.drop(0)
    assert ended == ["a:stopped"]
    await merged.aclose()
    assert sorted(ended) == ["a:stopped", "b:stopped"]


async def test_a_fan_in_never_started_opens_nothing() -> None:
    started = []

    async def child() -> AsyncIterator[TokenBatch]:
        started.append(1)
        yield TokenBatch([1], "stop")

    merged = FanIn([child(), child()])
    await merged.aclose()
    assert started == []


# -- the front end, through the SDK ----------------------------------------------------


ANSWERS = {"ab": "first answer.", "hello world": "second answer!"}


def answer(card: ModelCard) -> Any:
    def script(req: GenerationRequest) -> Script:
        prompt = card.tokenizer.decode(req.prompt_token_ids)
        seed = req.sampling.get("seed")
        return Script(text=ANSWERS[prompt] + (f" seed {seed}" if seed is not None else ""))

    return script


async def test_sdk_n_and_batch_non_streaming(make_proxy: ProxyFactory, card: ModelCard) -> None:
    proxy = await make_proxy(answer(card))
    async with client(proxy) as c:
        resp = await c.completions.create(
            model=MODEL, prompt=["ab", "hello world"], n=2, seed=3, max_tokens=50
        )
    assert [ch.index for ch in resp.choices] == [0, 1, 2, 3]
    assert [ch.text for ch in resp.choices] == [
        "first answer. seed 3",
        "first answer. seed 4",
        "second answer! seed 3",
        "second answer! seed 4",
    ]
    assert len(proxy.backend.calls) == 4
    assert all(call.outcome == "finished" and call.req.n == 1 for call in proxy.backend.calls)
    prompt_tokens = len(card.encode("ab")) + len(card.encode("hello world"))
    completion_tokens = sum(len(card.tokenizer.encode(ch.text).ids) for ch in resp.choices)
    assert resp.usage is not None
    assert (resp.usage.prompt_tokens, resp.usage.completion_tokens) == (
        prompt_tokens,
        completion_tokens,
    )
    assert len({call.req.request_id for call in proxy.backend.calls}) == 4


async def test_sdk_n_streaming_completion_and_chat(
    make_proxy: ProxyFactory, card: ModelCard
) -> None:
    proxy = await make_proxy(Script(text="The answer is 42.", tokens_per_batch=2))
    async with client(proxy) as c:
        stream = await c.completions.create(
            model=MODEL,
            prompt=["ab", "hello world"],
            n=2,
            max_tokens=50,
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = [ch async for ch in stream]
        chat = await c.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], n=3, stream=True
        )
        chat_chunks = [ch async for ch in chat]
    texts: dict[int, str] = {}
    for ch in chunks[:-1]:
        (choice,) = ch.choices
        texts[choice.index] = texts.get(choice.index, "") + choice.text
    assert texts == {k: "The answer is 42." for k in range(4)}
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    per_choice = len(card.tokenizer.encode("The answer is 42.").ids)
    assert chunks[-1].usage.completion_tokens == 4 * per_choice
    assert chunks[-1].usage.prompt_tokens == len(card.encode("ab")) + len(
        card.encode("hello world")
    )
    # chat: one role chunk per choice first (vLLM's first iteration), then content
    assert [(ch.choices[0].index, ch.choices[0].delta.role) for ch in chat_chunks[:3]] == [
        (0, "assistant"),
        (1, "assistant"),
        (2, "assistant"),
    ]
    content: dict[int, str] = {}
    finish: dict[int, str | None] = {}
    for ch in chat_chunks[3:]:
        (choice,) = ch.choices
        content[choice.index] = content.get(choice.index, "") + (choice.delta.content or "")
        finish[choice.index] = choice.finish_reason or finish.get(choice.index)
    assert content == {k: "The answer is 42." for k in range(3)}
    assert finish == {k: "stop" for k in range(3)}


async def test_sdk_echo(make_proxy: ProxyFactory, card: ModelCard) -> None:
    proxy = await make_proxy(Script(text=" and more"))
    ids = card.encode("hello world")
    async with client(proxy) as c:
        whole = await c.completions.create(model=MODEL, prompt="ab", echo=True, max_tokens=50)
        by_ids = await c.completions.create(model=MODEL, prompt=ids, echo=True, max_tokens=50)
        stream = await c.completions.create(
            model=MODEL, prompt=["ab", "hello world"], echo=True, max_tokens=50, stream=True
        )
        chunks = [ch async for ch in stream]
    assert whole.choices[0].text == "ab and more"
    assert (
        by_ids.choices[0].text
        == card.tokenizer.decode(ids, skip_special_tokens=False) + " and more"
    )
    first: dict[int, str] = {}
    for ch in chunks:
        first.setdefault(ch.choices[0].index, ch.choices[0].text)
    assert first[0].startswith("ab") and first[1].startswith("hello world")
    full = {
        k: "".join(ch.choices[0].text for ch in chunks if ch.choices[0].index == k) for k in (0, 1)
    }
    assert full == {0: "ab and more", 1: "hello world and more"}


async def test_echo_with_max_tokens_0_returns_the_prompt_alone(
    make_proxy: ProxyFactory, card: ModelCard
) -> None:
    """vLLM runs such a request for one token, shows none of it, and counts it in usage."""
    proxy = await make_proxy(Script(text=" and more"))
    async with client(proxy) as c:
        resp = await c.completions.create(
            model=MODEL, prompt=["ab", "hello world"], echo=True, max_tokens=0
        )
        stream = await c.completions.create(
            model=MODEL, prompt="ab", echo=True, max_tokens=0, n=2, stream=True
        )
        chunks = [ch async for ch in stream]
        with pytest.raises(openai.BadRequestError):
            await c.completions.create(model=MODEL, prompt="ab", max_tokens=0)
    assert [(ch.text, ch.finish_reason) for ch in resp.choices] == [
        ("ab", "length"),
        ("hello world", "length"),
    ]
    assert resp.usage is not None and resp.usage.completion_tokens == 2
    assert sorted((ch.choices[0].index, ch.choices[0].text) for ch in chunks) == [
        (0, "ab"),
        (1, "ab"),
    ]
    assert {call.req.max_tokens for call in proxy.backend.calls} == {1}


async def test_a_stop_string_ends_only_its_own_child(make_proxy: ProxyFactory) -> None:
    def script(req: GenerationRequest) -> Script:
        if req.request_id.endswith("-0"):  # cut early while the other goes on
            return Script(text="The answer is 42. Done and more to come", delay_s=0.01)
        return Script(text="No stop here at all", delay_s=0.05)

    proxy = await make_proxy(script)
    async with client(proxy) as c:
        resp = await c.completions.create(model=MODEL, prompt="x", n=2, stop=["42"], max_tokens=50)
    assert [ch.text for ch in resp.choices] == ["The answer is ", "No stop here at all"]
    cut, other = sorted(proxy.backend.calls, key=lambda call: call.req.request_id)
    assert cut.done.is_set() and cut.outcome in ("cancelled", "closed")
    assert cut.sent < len(
        proxy.card.tokenizer.encode("The answer is 42. Done and more to come").ids
    )
    assert other.sent == len(proxy.card.tokenizer.encode("No stop here at all").ids)


async def test_a_failing_child_ends_the_response_and_aborts_the_others(
    make_proxy: ProxyFactory,
) -> None:
    def script(req: GenerationRequest) -> Script:
        if req.request_id.endswith("-1"):
            return Script(fail_after=(3, BackendError("decode instance went away")), delay_s=0.01)
        return Script(text="The answer is 42.", hang_after=2)

    proxy = await make_proxy(script)
    async with client(proxy) as c:
        with pytest.raises(openai.APIStatusError) as info:
            await c.completions.create(model=MODEL, prompt="x", n=3, max_tokens=50)
        assert info.value.status_code == 502
        stream = await c.completions.create(
            model=MODEL, prompt="x", n=3, max_tokens=50, stream=True
        )
        with pytest.raises(openai.APIError):
            async for _ in stream:
                pass
    async with asyncio.timeout(30):
        for call in proxy.backend.calls:
            await call.done.wait()
    outcomes = sorted(call.outcome for call in proxy.backend.calls)
    assert outcomes == ["cancelled"] * 4 + ["failed"] * 2
    assert proxy.app.active == 0


async def test_a_client_that_goes_away_aborts_every_child(make_proxy: ProxyFactory) -> None:
    """Once the stream's resume grace has run out (it is held for a resume meanwhile, as
    a single choice's is: tests/proxy/test_resume.py)."""
    proxy = await make_proxy(Script(text="The answer is 42.", hang_after=2), resume_grace_s=0.3)
    async with client(proxy) as c:
        stream = await c.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "x"}], n=3, stream=True
        )
        await anext(aiter(stream))
        await stream.close()
    async with asyncio.timeout(30):
        for call in proxy.backend.calls:
            await call.done.wait()
    assert [call.outcome for call in proxy.backend.calls] == ["cancelled"] * 3

    # and one waiting for a whole (non-streaming) answer
    _, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
    writer.write(
        request_bytes("POST", "/v1/completions", {"model": MODEL, "prompt": ["a", "b"], "n": 2})
    )
    await until(
        lambda: len(proxy.backend.calls) == 7 and all(c.sent for c in proxy.backend.calls[3:])
    )
    writer.close()
    await writer.wait_closed()
    async with asyncio.timeout(30):
        for call in proxy.backend.calls[3:]:
            await call.done.wait()
    assert [call.outcome for call in proxy.backend.calls[3:]] == ["cancelled"] * 4
    await until(lambda: proxy.app.active == 0)


async def test_wire_shape_of_a_batched_streamed_completion(make_proxy: ProxyFactory) -> None:
    proxy = await make_proxy(Script(text="ok"))
    raw = request_bytes(
        "POST",
        "/v1/completions",
        {"model": MODEL, "prompt": [[5, 6], [7]], "stream": True, "max_tokens": 5},
        {"connection": "close"},
    )
    (resp,) = parse_responses(await exchange(proxy.port, raw))
    events = [e[6:] for e in resp.body.decode().split("\n\n") if e]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert {c["id"] for c in chunks} == {chunks[0]["id"]}
    assert all(len(c["choices"]) == 1 and c["object"] == "text_completion" for c in chunks)
    assert sorted({c["choices"][0]["index"] for c in chunks}) == [0, 1]
