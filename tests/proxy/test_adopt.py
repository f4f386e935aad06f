"""A stream resumed on a proxy that never ran it: taken over from its worker (proxy.adopt).

A real TokenServer over the scripted engine, real sockets, and a real
ProxyApp + ClusterBackend as the second proxy. The first proxy is a raw
connection that opens the request as the proxy would (ResumableGenerate with
the response's context), reads a few tokens, and dies. The client then
resumes on the second proxy with the last event id it got: the joined text
and the token count are an unbroken stream's.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

import httpx
import pytest

from proxy import resume, sse
from proxy.app import ProxyApp, _adopted, create_server
from proxy.backend import TokenBatch
from proxy.cluster import ClusterBackend, Directory
from proxy.decode_run import Found
from proxy.fanout import children
from proxy.http import HttpError, HttpServer
from proxy.openai import ParsedRequest, Relay, parse_chat, parse_completion
from proxy.resume import Position, Reader, Tagger, context_of, fan_of, request_of
from proxy.stream_context import with_prompt_logprobs
from proxy.tokenizer import ModelCard
from proxy.upstream import WorkerPool
from star.settings import ProxySettings
from star.wire import Attached, Hello, PromptLogprobs, ResumableGenerate, Tokens
from tests.e2e.streams import SSE, texts
from tests.proxy.rawhttp import until
from tests.reports import report
from tests.workers.fakes import Client, FakeEngine
from workers.server import TokenServer

SECRET = "cluster-secret"
TOKENS = 40
FIRST = 36  # "A" in the test tokenizer
HELLO = Hello(instance="decode-0", role="decode", model="tiny")


def _parsed(card: ModelCard, chat: bool) -> ParsedRequest:
    body: dict[str, Any] = {
        "model": "tiny",
        "stream": True,
        "max_tokens": TOKENS,
        "stream_options": {"include_usage": True},
        "stop": ["never-in-the-text"],
    }
    if chat:
        body["messages"] = [{"role": "user", "content": "hi"}]
        return parse_chat(json.dumps(body).encode(), {"tiny": card})
    return parse_completion(json.dumps(body | {"prompt": "héllo"}).encode(), {"tiny": card})


def _text(events: list[sse.Event]) -> str:
    out = []
    for ev in events:
        if ev.data != sse.DONE_DATA:
            for choice in json.loads(ev.data)["choices"]:
                out.append(choice.get("text") or choice.get("delta", {}).get("content") or "")
    return "".join(out)


def _usage(events: list[sse.Event]) -> int:
    (usage,) = [json.loads(e.data)["usage"] for e in events if '"usage":{' in e.data]
    return int(usage["completion_tokens"])


def test_the_context_round_trips(card: ModelCard) -> None:
    for chat in (False, True):
        parsed = _parsed(card, chat)
        again, created = request_of(
            context_of(parsed, 123), [parsed.gen.prompt_token_ids], {"tiny": card}
        )
        assert created == 123 and again.text == parsed.text and again.echo == parsed.echo
        for field in ("request_id", "model", "kind", "stop", "include_usage", "migratable"):
            assert getattr(again.gen, field) == getattr(parsed.gen, field), field
        assert dict(again.gen.sampling) == dict(parsed.gen.sampling)
        assert fan_of(context_of(parsed, 1)) == (1, 1)
    body = {"model": "tiny", "stream": True, "prompt": ["héllo", "wörld"], "n": 2}
    fanned = parse_completion(json.dumps(body).encode(), {"tiny": card})
    context = context_of(fanned, 1)
    assert fan_of(context) == (2, 2)
    again, _ = request_of(context, list(fanned.batch), {"tiny": card})
    assert again.batch == fanned.batch and again.num_choices == 4


@pytest.fixture
async def worker() -> AsyncIterator[tuple[TokenServer, FakeEngine]]:
    engine = FakeEngine(step_s=0.01, first_id=FIRST)  # ids of ASCII letters
    srv = TokenServer(engine, HELLO, "127.0.0.1", 0, orphan_grace_s=5.0)
    await srv.start()
    yield srv, engine
    await srv.shutdown(drain_timeout=0.1)


@pytest.fixture
async def second_proxy(
    worker: tuple[TokenServer, FakeEngine], card: ModelCard
) -> AsyncIterator[tuple[ProxyApp, HttpServer]]:
    srv, _ = worker
    bus = SimpleNamespace(keys=SimpleNamespace(reports="t:reports"))  # only named in errors
    directory = Directory(bus, staleness_s=60)  # type: ignore[arg-type]
    directory._reports["decode-0"] = (time.monotonic(), report("decode-0", address=srv.address))
    pool = WorkerPool()
    backend = ClusterBackend(directory, pool, "current-load", "proxy:b")
    settings = ProxySettings(host="127.0.0.1", port=0)
    app = ProxyApp(backend, [card], settings, secret=SECRET)
    http = create_server(app, settings)
    await http.start()
    yield app, http
    await http.shutdown(timeout_s=1.0)
    app.close()
    await pool.close()


@pytest.mark.parametrize("chat", [False, True])
async def test_a_stream_of_a_dead_proxy_resumes_on_another_exactly(
    worker: tuple[TokenServer, FakeEngine],
    second_proxy: tuple[ProxyApp, HttpServer],
    card: ModelCard,
    chat: bool,
) -> None:
    srv, engine = worker
    _, http = second_proxy
    parsed = _parsed(card, chat)
    gen = parsed.gen
    tagger = Tagger(SECRET)
    # The first proxy: opens the request, relays a few tokens, dies.
    first = await Client.connect(srv.address)
    assert await first.recv() == HELLO
    await first.send(
        ResumableGenerate(
            stream=1,
            request_id=gen.request_id,
            prompt_token_ids=gen.prompt_token_ids,
            sampling=dict(gen.sampling),
            context=context_of(parsed, 77),
        )
    )
    reader = Reader(Relay(parsed, created=77), Position(), tagger)
    out = b""
    got = 0
    while got < 5 or out.count(b"id: ") < 2:  # some ids are bytes of one character
        msg = await first.recv()
        assert isinstance(msg, Tokens)
        got += len(msg.token_ids)
        out += reader.feed(TokenBatch(list(msg.token_ids)))
    await first.close()
    before = sse.SSEDecoder().feed(out)
    assert before and before[-1].id
    # The unbroken stream, for the comparison (the scripted engine is deterministic).
    whole_reader = Reader(Relay(parsed, created=77), Position(), tagger)
    ids = [FIRST + i for i in range(TOKENS)]
    whole = sse.SSEDecoder().feed(whole_reader.feed(TokenBatch(ids, "length")) + whole_reader.end())
    await asyncio.sleep(0.1)  # the orphan decodes on
    async with httpx.AsyncClient(
        base_url=f"http://127.0.0.1:{http.port}", timeout=30, headers=SSE
    ) as c:
        async with c.stream("GET", f"/v1/streams/{before[-1].id}") as resp:
            assert resp.status_code == 200, await resp.aread()
            decoder, after = sse.SSEDecoder(), []
            async for chunk in resp.aiter_raw():
                after += decoder.feed(chunk)
    assert _text(before + after) == _text(whole) != ""
    assert _usage(after) == _usage(whole) == TOKENS
    assert after[-1].data == sse.DONE_DATA
    assert json.loads(after[0].data)["created"] == 77  # the first proxy's response, continued
    assert engine.finished == [gen.request_id] and engine.started == [gen.request_id]


async def test_a_stream_no_worker_holds_is_404_and_a_forged_one_403(
    second_proxy: tuple[ProxyApp, HttpServer],
) -> None:
    _, http = second_proxy
    unknown = Tagger(SECRET).format("cmpl-nowhere", Position(3, 9, 1))
    forged = Tagger("another").format("cmpl-nowhere", Position(3, 9, 1))
    async with httpx.AsyncClient(
        base_url=f"http://127.0.0.1:{http.port}", timeout=30, headers=SSE
    ) as c:
        missing = await c.get(f"/v1/streams/{unknown}")
        refused = await c.get(f"/v1/streams/{forged}")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "stream_not_found"
    assert refused.status_code == 403


async def test_an_adopted_stream_is_held_too_and_aborted_after_the_grace(
    worker: tuple[TokenServer, FakeEngine],
    second_proxy: tuple[ProxyApp, HttpServer],
    card: ModelCard,
) -> None:
    srv, engine = worker
    app, http = second_proxy
    app.streams.grace_s = 0.3
    parsed = _parsed(card, False)
    gen = parsed.gen
    first = await Client.connect(srv.address)
    assert await first.recv() == HELLO
    sampling = dict(gen.sampling) | {"max_tokens": 100_000}
    await first.send(
        ResumableGenerate(
            stream=1,
            request_id=gen.request_id,
            prompt_token_ids=gen.prompt_token_ids,
            sampling=sampling,
            context=context_of(parsed, 1),
        )
    )
    assert isinstance(await first.recv(), Tokens)
    await first.close()
    start = Tagger(SECRET).format(gen.request_id, Position())
    async with httpx.AsyncClient(
        base_url=f"http://127.0.0.1:{http.port}", timeout=30, headers=SSE
    ) as c:
        async with c.stream("GET", f"/v1/streams/{start}") as resp:
            assert resp.status_code == 200
            async for _chunk in resp.aiter_raw():
                break  # and the client goes away again
    await until(lambda: gen.request_id in engine.aborted, wait_s=10)
    assert app.streams.live == {}


async def _cut_by_a_stopping_proxy(
    srv: TokenServer, card: ModelCard, body: dict[str, Any]
) -> list[sse.Event]:
    """The events a client of proxy A got of ``body`` before SIGTERM's drain ran out
    (the streams still open are cut without an Abort: the worker holds them)."""
    bus = SimpleNamespace(keys=SimpleNamespace(reports="t:reports"))
    directory = Directory(bus, staleness_s=60)  # type: ignore[arg-type]
    directory._reports["decode-0"] = (time.monotonic(), report("decode-0", address=srv.address))
    pool = WorkerPool()
    backend = ClusterBackend(directory, pool, "current-load", "proxy:a")
    settings = ProxySettings(host="127.0.0.1", port=0)
    app = ProxyApp(backend, [card], settings, secret=SECRET)
    http_a = create_server(app, settings)
    await http_a.start()
    first: list[sse.Event] = []
    try:
        async with httpx.AsyncClient(
            base_url=f"http://127.0.0.1:{http_a.port}", timeout=30, headers=SSE
        ) as c:
            async with c.stream("POST", "/v1/completions", json=body) as resp:
                decoder = sse.SSEDecoder()
                async for chunk in resp.aiter_raw():
                    first += decoder.feed(chunk)
                    if len(first) >= 3:
                        break

                def hand_off() -> None:
                    backend.handing_off = True

                await http_a.shutdown(timeout_s=0.1, on_timeout=hand_off)  # SIGTERM's drain
    except httpx.HTTPError:
        pass  # the cut
    app.close()
    await pool.close()
    return first


async def _resumed(http: HttpServer, last: sse.Event) -> list[sse.Event]:
    """The events of a resume from ``last`` on the proxy ``http``."""
    async with httpx.AsyncClient(
        base_url=f"http://127.0.0.1:{http.port}", timeout=30, headers=SSE
    ) as c:
        async with c.stream("GET", f"/v1/streams/{last.id}") as resp:
            assert resp.status_code == 200, await resp.aread()
            decoder, rest = sse.SSEDecoder(), []
            async for chunk in resp.aiter_raw():
                rest += decoder.feed(chunk)
    return rest


async def test_a_stopping_proxy_hands_its_streams_to_the_workers(
    worker: tuple[TokenServer, FakeEngine],
    second_proxy: tuple[ProxyApp, HttpServer],
    card: ModelCard,
) -> None:
    """SIGTERM's drain runs out (issue 26 item 2): the streams still open are cut without
    an Abort, the worker holds them, and the clients resume on another proxy exactly."""
    srv, engine = worker
    _, http_b = second_proxy
    engine.step_s = 0.02
    body = {
        "model": "tiny",
        "prompt": "héllo",
        "max_tokens": TOKENS,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    first = await _cut_by_a_stopping_proxy(srv, card, body)
    assert first and engine.live == {first_request(engine)}  # held by the worker, not aborted
    rest = await _resumed(http_b, first[-1])
    letters = "".join(card.tokenizer.decode([FIRST + i]) for i in range(TOKENS))
    assert _text(first + rest) == letters
    assert _usage(rest) == TOKENS and engine.aborted == []


async def test_a_fanned_out_stream_of_a_stopping_proxy_resumes_on_another(
    worker: tuple[TokenServer, FakeEngine],
    second_proxy: tuple[ProxyApp, HttpServer],
    card: ModelCard,
) -> None:
    """Two prompts, n = 2 (issue 26): four upstream requests, each held by the worker when
    proxy A stops; proxy B takes each over, and every choice's text and the usage joined
    at the client's last event are an unbroken stream's."""
    srv, engine = worker
    _, http_b = second_proxy
    engine.step_s = 0.02
    body = {
        "model": "tiny",
        "prompt": ["héllo", "wörld"],
        "n": 2,
        "max_tokens": TOKENS,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    first = await _cut_by_a_stopping_proxy(srv, card, body)
    assert len(engine.live) == 4  # held by the worker, not aborted
    rest = await _resumed(http_b, first[-1])
    letters = "".join(card.tokenizer.decode([FIRST + i]) for i in range(TOKENS))
    assert texts(first + rest) == dict.fromkeys(range(4), letters)
    assert _usage(rest) == 4 * TOKENS and engine.aborted == []
    assert sorted(engine.finished) == sorted(engine.started) and len(engine.started) == 4


def first_request(engine: FakeEngine) -> str:
    return engine.started[0]


@pytest.mark.parametrize("chat", [False, True])
async def test_a_stream_whose_worker_dropped_its_proxy_runs_on_there(
    worker: tuple[TokenServer, FakeEngine],
    second_proxy: tuple[ProxyApp, HttpServer],
    card: ModelCard,
    chat: bool,
) -> None:
    """A worker drops a starved proxy as silent: the proxy attaches its requests
    there again (stream_rejoined) instead of recomputing them elsewhere while
    the orphans decode on (an e2e cell at 2P+6D held 208 such orphans, 121 of
    them decoding their whole grace beside their recompute)."""
    srv, engine = worker
    _, http = second_proxy
    parsed = _parsed(card, chat)
    route = "/v1/chat/completions" if chat else "/v1/completions"
    body: dict[str, Any] = {"model": "tiny", "stream": True, "max_tokens": TOKENS}
    body |= {"stream_options": {"include_usage": True}, "stop": ["never-in-the-text"]}
    body |= {"messages": [{"role": "user", "content": "hi"}]} if chat else {"prompt": "héllo"}
    whole_reader = Reader(Relay(parsed, created=77), Position(), Tagger(SECRET))
    ids = [FIRST + i for i in range(TOKENS)]
    whole = sse.SSEDecoder().feed(whole_reader.feed(TokenBatch(ids, "length")) + whole_reader.end())
    events: list[sse.Event] = []
    async with httpx.AsyncClient(
        base_url=f"http://127.0.0.1:{http.port}", timeout=30, headers=SSE
    ) as c:
        async with c.stream("POST", route, json=body) as resp:
            assert resp.status_code == 200, await resp.aread()
            decoder, dropped = sse.SSEDecoder(), False
            async for chunk in resp.aiter_raw():
                events += decoder.feed(chunk)
                if not dropped and len(events) >= 4:
                    dropped = True
                    for conn in list(srv._connections):  # the worker finds its proxy silent
                        conn._silent(2.0)
    assert dropped and _text(events) == _text(whole) != ""
    assert _usage(events) == TOKENS and events[-1].data == sse.DONE_DATA
    # One engine request, never started again elsewhere, never an orphan aborted.
    (rid,) = set(engine.started)
    assert engine.started == [rid] and engine.finished == [rid] and engine.aborted == []


@pytest.mark.parametrize("case", ["restarted", "context-without-prompts", "client-has-tokens"])
async def test_a_choice_no_worker_holds_runs_again_unless_its_client_has_tokens_of_it(
    worker: tuple[TokenServer, FakeEngine],
    second_proxy: tuple[ProxyApp, HttpServer],
    card: ModelCard,
    case: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Two prompts, n = 2: proxy A dies while choices 2 and 3 (prompt 1) are still in
    prefill, so no decode worker holds them (CI at bcaf900 got 404 here). Proxy B takes
    over choices 0 and 1 and runs 2 and 3 again, their prompt from the context: every
    choice's text is an unbroken stream's. A 404 when the context lacks the prompts
    (past resume.BATCH_CONTEXT_TOKENS) or the client has tokens of a choice none holds."""
    srv, engine = worker
    _, http = second_proxy
    if case == "context-without-prompts":
        monkeypatch.setattr(resume, "BATCH_CONTEXT_TOKENS", 0)
    body = {"model": "tiny", "prompt": ["héllo", "wörld"], "n": 2, "max_tokens": TOKENS}
    body |= {"stream": True, "stream_options": {"include_usage": True}}
    parsed = parse_completion(json.dumps(body).encode(), {"tiny": card})
    context = context_of(parsed, 77)
    reqs = children(parsed)
    first = await Client.connect(srv.address)
    assert await first.recv() == HELLO
    for stream, req in enumerate(reqs[:2], start=1):  # choices 0 and 1 reached decode-0
        await first.send(
            ResumableGenerate(
                stream=stream,
                request_id=req.request_id,
                prompt_token_ids=req.prompt_token_ids,
                sampling=dict(req.sampling),
                context=context,
            )
        )
    reader = Reader(Relay(parsed, created=77), (Position(),) * 4, Tagger(SECRET))
    out, got = b"", 0
    while got < 6:
        msg = await first.recv()
        assert isinstance(msg, Tokens)
        got += len(msg.token_ids)
        out += reader.feed(TokenBatch(list(msg.token_ids), index=msg.stream - 1))
    await first.close()
    if case == "client-has-tokens":  # as if choice 2 had sent a token before its end
        out += reader.feed(TokenBatch([FIRST], index=2))
    before = sse.SSEDecoder().feed(out)
    async with httpx.AsyncClient(
        base_url=f"http://127.0.0.1:{http.port}", timeout=30, headers=SSE
    ) as c:
        async with c.stream("GET", f"/v1/streams/{before[-1].id}") as resp:
            if case != "restarted":
                assert resp.status_code == 404, await resp.aread()
                error = json.loads(await resp.aread())["error"]
                assert error["code"] == "stream_not_found"
                assert ("(choice 2)" in error["message"]) == (case == "client-has-tokens")
                await until(lambda: len(engine.aborted) == 2, wait_s=10)  # its legs closed
                return
            assert resp.status_code == 200, await resp.aread()
            decoder, after = sse.SSEDecoder(), []
            async for chunk in resp.aiter_raw():
                after += decoder.feed(chunk)
    letters = "".join(card.tokenizer.decode([FIRST + i]) for i in range(TOKENS))
    assert texts(before + after) == dict.fromkeys(range(4), letters)
    assert _usage(after) == 4 * TOKENS and after[-1].data == sse.DONE_DATA
    assert sorted(engine.started) == sorted(r.request_id for r in reqs) == sorted(engine.finished)


def test_a_take_over_before_the_first_chunk_echoes_the_prompts_real_logprobs(
    card: ModelCard,
) -> None:
    """An echo with logprobs taken over before its client had a chunk (issue 26): the
    prefill's prompt logprobs reach the decode leg's context (adopt.with_prompt_logprobs),
    or the worker that prefilled it keeps them (Attached.prompt), so the taking-over proxy
    sends what an unbroken stream sends; with neither, a 409 as before."""
    body = {"model": "tiny", "prompt": "héllo", "echo": True, "logprobs": 1, "max_tokens": 4}
    parsed = parse_completion(json.dumps(body | {"stream": True}).encode(), {"tiny": card})
    rid, prompt = parsed.gen.request_id, parsed.gen.prompt_token_ids
    n = len(prompt) - 1
    scores = PromptLogprobs(0, [-0.5] * n, [2] * n, [FIRST] * n, [-0.25] * n)
    out = {"logprobs": [-1.0, -1.5], "top_ids": [FIRST, FIRST], "top_logprobs": [-1.0, -1.5]}
    tagger = Tagger(SECRET)
    unbroken = Reader(Relay(parsed, created=1), Position(), tagger)
    want = unbroken.feed(TokenBatch([FIRST, FIRST + 1], prompt=scores, **out))  # type: ignore[arg-type]
    for context, held, ok in (
        (with_prompt_logprobs(context_of(parsed, 1), scores), None, True),
        (context_of(parsed, 1), scores, True),  # the worker prefilled it: its Record has them
        (context_of(parsed, 1), None, False),
    ):
        done = Attached(1, rid, prompt, [FIRST, FIRST + 1], context, **out)
        if held is not None:
            done = Attached(1, rid, prompt, [FIRST, FIRST + 1], context, **out, prompt=held)
        found = Found(done, "decode-0", "127.0.0.1:1", None)  # type: ignore[arg-type]
        if not ok:
            with pytest.raises(HttpError) as info:
                _adopted(rid, [found], (Position(),), {"tiny": card})
            assert (info.value.status, info.value.code) == (409, "stream_logprobs_gone")
            continue
        again, _, ((first, known),) = _adopted(rid, [found], (Position(),), {"tiny": card})
        assert first is not None and first.prompt == scores and known == 0
        taken = Reader(Relay(again, created=1), Position(), tagger)
        assert taken.feed(first) == want  # the echo, its logprobs and the ids: byte for byte
