"""The whole front end: the official openai SDK and raw sockets against a fake backend."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import openai
import pytest
from tokenizers import Tokenizer

from proxy import sse
from proxy.app import ProxyApp, create_server
from proxy.backend import BackendUnavailable, RequestRejected
from proxy.tokenizer import ModelCard
from star.settings import ProxySettings
from tests.proxy.conftest import Proxy, ProxyFactory
from tests.proxy.fakes import FakeBackend, Script
from tests.proxy.rawhttp import RawResponse, exchange, parse_responses, request_bytes, until

ANSWER = "Héllo wörld, 你好 😀! The answer is 42."


def client(proxy: Proxy, key: str = "none") -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=proxy.base_url, api_key=key, max_retries=0, timeout=60)


async def post(proxy: Proxy, path: str, payload: dict[str, object], **headers: str) -> list:
    raw = request_bytes("POST", path, payload, {"connection": "close", **headers})
    return parse_responses(await exchange(proxy.port, raw))


async def test_sdk_completions_non_streaming(make_proxy: ProxyFactory) -> None:
    proxy = await make_proxy(Script(text=ANSWER))
    async with client(proxy) as c:
        resp = await c.completions.create(model="tiny", prompt="Say hi", max_tokens=100)
    assert resp.object == "text_completion"
    assert resp.id.startswith("cmpl-")
    assert resp.choices[0].text == ANSWER
    assert resp.choices[0].finish_reason == "stop"
    n_answer = len(proxy.card.tokenizer.encode(ANSWER).ids)
    n_prompt = len(proxy.card.tokenizer.encode("Say hi").ids)
    assert resp.usage is not None
    assert (resp.usage.prompt_tokens, resp.usage.completion_tokens, resp.usage.total_tokens) == (
        n_prompt,
        n_answer,
        n_prompt + n_answer,
    )
    (call,) = proxy.backend.calls
    assert call.req.request_id == resp.id and call.outcome == "finished"


async def test_sdk_completions_streaming_with_usage(make_proxy: ProxyFactory) -> None:
    proxy = await make_proxy(Script(text=ANSWER))
    async with client(proxy) as c:
        stream = await c.completions.create(
            model="tiny",
            prompt="Say hi",
            max_tokens=100,
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = [chunk async for chunk in stream]
    text = "".join(ch.choices[0].text for ch in chunks if ch.choices)
    assert text == ANSWER
    assert chunks[-2].choices[0].finish_reason == "stop"
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == len(proxy.card.tokenizer.encode(ANSWER).ids)
    assert all(ch.usage is None for ch in chunks[:-1])
    assert len({ch.id for ch in chunks}) == 1


async def test_sdk_chat_non_streaming_and_streaming(make_proxy: ProxyFactory) -> None:
    proxy = await make_proxy(Script(text=ANSWER))
    messages = [{"role": "user", "content": "hi"}]
    async with client(proxy) as c:
        resp = await c.chat.completions.create(model="tiny", messages=messages)  # type: ignore[arg-type]
        assert resp.object == "chat.completion" and resp.id.startswith("chatcmpl-")
        assert resp.choices[0].message.role == "assistant"
        assert resp.choices[0].message.content == ANSWER
        assert resp.choices[0].finish_reason == "stop"
        stream = await c.chat.completions.create(model="tiny", messages=messages, stream=True)  # type: ignore[arg-type]
        chunks = [chunk async for chunk in stream]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == ANSWER
    assert chunks[-1].choices[0].finish_reason == "stop"
    assert all(ch.object == "chat.completion.chunk" for ch in chunks)
    prompt = proxy.backend.calls[0].req.prompt_token_ids
    assert proxy.card.tokenizer.decode(prompt, skip_special_tokens=False).endswith(
        "<|im_start|>assistant\n"
    )


async def test_max_tokens_gives_finish_reason_length(make_proxy: ProxyFactory) -> None:
    proxy = await make_proxy(Script(text=ANSWER))
    async with client(proxy) as c:
        resp = await c.completions.create(model="tiny", prompt="x", max_tokens=3)
    assert resp.choices[0].finish_reason == "length"
    assert resp.usage is not None and resp.usage.completion_tokens == 3


async def test_stop_string_cuts_and_aborts_the_backend(make_proxy: ProxyFactory) -> None:
    proxy = await make_proxy(Script(text=ANSWER))
    async with client(proxy) as c:
        stream = await c.completions.create(
            model="tiny", prompt="x", max_tokens=100, stop=["42"], stream=True
        )
        text = "".join([ch.choices[0].text async for ch in stream])
        resp = await c.completions.create(model="tiny", prompt="x", max_tokens=100, stop="answer")
    assert text == ANSWER[: ANSWER.index("42")]
    assert resp.choices[0].text == ANSWER[: ANSWER.index("answer")]
    assert resp.choices[0].finish_reason == "stop"
    assert [c.outcome for c in proxy.backend.calls] == ["closed", "closed"]


async def test_sse_wire_format_ends_with_done(make_proxy: ProxyFactory) -> None:
    proxy = await make_proxy(Script(text="ab"))
    (resp,) = await post(
        proxy,
        "/v1/completions",
        {"model": "tiny", "prompt": "x", "stream": True, "stream_options": {"include_usage": True}},
        accept="text/event-stream",  # an SSE client: ids (without: tests/proxy/test_resume.py)
    )
    assert resp.status == 200
    assert resp.headers["content-type"] == "text/event-stream; charset=utf-8"
    assert resp.headers["transfer-encoding"] == "chunked"
    assert resp.body.endswith(b"\n\ndata: [DONE]\n\n")
    events = sse.SSEDecoder().feed(resp.body)
    parts = [part.split(b"\n") for part in resp.body.split(b"\n\n") if part]
    assert all(lines[-1].startswith(b"data: ") for lines in parts)
    # Every event but [DONE] has its id first (proxy.resume), then its data.
    assert all(lines[0].startswith(b"id: cmpl-") and len(lines) == 2 for lines in parts[:-1])
    usage = json.loads(events[-2].data)
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 1


async def test_unknown_model_is_404_model_not_found(proxy: Proxy) -> None:
    (resp,) = await post(proxy, "/v1/completions", {"model": "gpt-9", "prompt": "x"})
    assert resp.status == 404
    assert resp.json() == {
        "error": {
            "message": "The model `gpt-9` does not exist.",
            "type": "NotFoundError",
            "param": "model",
            "code": "model_not_found",
        }
    }
    async with client(proxy) as c:
        with pytest.raises(openai.NotFoundError):
            await c.chat.completions.create(
                model="gpt-9", messages=[{"role": "user", "content": "x"}]
            )


async def test_bad_param_is_400_naming_it(proxy: Proxy) -> None:
    (resp,) = await post(
        proxy,
        "/v1/chat/completions",
        {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "temperature": 9},
    )
    assert resp.status == 400 and resp.json()["error"]["param"] == "temperature"
    async with client(proxy) as c:
        with pytest.raises(openai.BadRequestError) as info:
            await c.completions.create(model="tiny", prompt="x", top_p=5)
    assert info.value.param == "top_p"
    assert proxy.backend.calls == []


async def test_api_key_missing_or_wrong_is_401(make_proxy: ProxyFactory) -> None:
    proxy = await make_proxy(api_key="sekrit")
    payload = {"model": "tiny", "prompt": "x"}
    (missing,) = await post(proxy, "/v1/completions", payload)
    (wrong,) = await post(proxy, "/v1/completions", payload, authorization="Bearer nope")
    (right,) = await post(proxy, "/v1/completions", payload, authorization="Bearer sekrit")
    for resp in (missing, wrong):
        assert resp.status == 401
        assert resp.headers["www-authenticate"] == "Bearer"
        assert set(resp.json()["error"]) == {"message", "type", "param", "code"}
    assert wrong.json()["error"]["code"] == "invalid_api_key"
    assert right.status == 200
    async with client(proxy, key="nope") as c:
        with pytest.raises(openai.AuthenticationError):
            await c.models.list()
    async with client(proxy, key="sekrit") as c:
        assert [m.id for m in (await c.models.list()).data] == ["tiny"]
        assert (await c.models.retrieve("tiny")).id == "tiny"
    (health,) = parse_responses(
        await exchange(proxy.port, request_bytes("GET", "/health", headers={"connection": "close"}))
    )
    assert health.status == 200  # probes need no key


async def test_too_many_streams_is_429(make_proxy: ProxyFactory) -> None:
    proxy = await make_proxy(Script(text=ANSWER, hang_after=2), max_streams=2, resume_grace_s=0)
    async with client(proxy) as c:
        streams = [
            await c.completions.create(model="tiny", prompt="x", max_tokens=50, stream=True)
            for _ in range(2)
        ]
        with pytest.raises(openai.RateLimitError):
            await c.completions.create(model="tiny", prompt="x", stream=True)
        for s in streams:
            await s.close()
    await until(lambda: proxy.server.active == 0)
    assert [call.outcome for call in proxy.backend.calls] == ["cancelled", "cancelled"]


async def test_client_disconnect_cancels_the_backend_generator(make_proxy: ProxyFactory) -> None:
    # resume_grace_s 0: no hold for a resume (tests/proxy/test_resume.py holds)
    proxy = await make_proxy(Script(text=ANSWER, hang_after=3), resume_grace_s=0)
    async with client(proxy) as c:
        stream = await c.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "x"}], stream=True
        )
        got = [await anext(aiter(stream)) for _ in range(2)]
        assert got[1].choices[0].delta.content
        await stream.close()
    (call,) = proxy.backend.calls
    async with asyncio.timeout(30):
        await call.done.wait()
    assert call.outcome == "cancelled"
    assert proxy.app.active == 0 and proxy.server.active == 0


async def test_disconnect_while_waiting_for_a_non_streaming_answer(
    make_proxy: ProxyFactory,
) -> None:
    proxy = await make_proxy(Script(text=ANSWER, hang_after=1))
    _, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
    writer.write(request_bytes("POST", "/v1/completions", {"model": "tiny", "prompt": "x"}))
    await until(lambda: bool(proxy.backend.calls) and proxy.backend.calls[0].sent >= 1)
    writer.close()
    await writer.wait_closed()
    async with asyncio.timeout(30):
        await proxy.backend.calls[0].done.wait()
    assert proxy.backend.calls[0].outcome == "cancelled"


async def test_backend_errors_before_and_during_the_stream(make_proxy: ProxyFactory) -> None:
    def script(req):  # type: ignore[no-untyped-def]
        if req.sampling.get("temperature") == 0.1:
            return Script(fail_before=BackendUnavailable("no decode instance is up"))
        if req.sampling.get("temperature") == 0.2:
            return Script(
                fail_before=RequestRejected("prompt too long for the engine", code="too_long")
            )
        return Script(text=ANSWER, fail_after=(3, BackendUnavailable("decode instance died")))

    proxy = await make_proxy(script)
    (r503,) = await post(
        proxy,
        "/v1/completions",
        {"model": "tiny", "prompt": "x", "temperature": 0.1, "stream": True},
    )
    assert r503.status == 503 and r503.json()["error"]["type"] == "service_unavailable"
    assert "(request id cmpl-" in r503.json()["error"]["message"]  # the detail is in the log
    (r400,) = await post(
        proxy, "/v1/completions", {"model": "tiny", "prompt": "x", "temperature": 0.2}
    )
    assert r400.status == 400 and r400.json()["error"]["code"] == "too_long"
    (mid,) = await post(proxy, "/v1/completions", {"model": "tiny", "prompt": "x", "stream": True})
    assert mid.status == 200
    events = [e.data for e in sse.SSEDecoder().feed(mid.body)]
    assert events[-1] == "[DONE]"
    message = json.loads(events[-2])["error"]["message"]
    assert "died" not in message and "(request id cmpl-" in message
    (nonstream,) = await post(proxy, "/v1/completions", {"model": "tiny", "prompt": "x"})
    assert nonstream.status == 503
    assert proxy.app.active == 0


async def test_a_backend_bug_is_a_500_or_an_error_event(make_proxy: ProxyFactory) -> None:
    proxy = await make_proxy(Script(text=ANSWER, fail_after=(2, KeyError("oops"))))
    (plain,) = await post(proxy, "/v1/completions", {"model": "tiny", "prompt": "x"})
    assert plain.status == 500 and "oops" not in plain.body.decode()
    (stream,) = await post(
        proxy, "/v1/completions", {"model": "tiny", "prompt": "x", "stream": True}
    )
    events = [e.data for e in sse.SSEDecoder().feed(stream.body)]
    assert stream.status == 200 and events[-1] == "[DONE]"
    assert json.loads(events[-2])["error"]["type"] == "server_error"
    assert proxy.app.active == 0 and proxy.server.active == 0


async def test_backend_ending_without_finish_is_502(make_proxy: ProxyFactory) -> None:
    proxy = await make_proxy(Script(text="abc", end_without_finish=True))
    (resp,) = await post(proxy, "/v1/completions", {"model": "tiny", "prompt": "x"})
    assert resp.status == 502 and resp.json()["error"]["code"] == "upstream_error"


async def test_health_metrics_and_unknown_routes(make_proxy: ProxyFactory) -> None:
    proxy = await make_proxy(Script(text="hello world"))
    async with client(proxy) as c:
        await c.completions.create(model="tiny", prompt="x", stream=False)
        stream = await c.completions.create(model="tiny", prompt="x", stream=True)
        async for _ in stream:
            pass
    raw = b"".join(request_bytes("GET", p) for p in ("/health", "/metrics", "/nope"))
    raw += request_bytes("GET", "/v1/completions", headers={"connection": "close"})
    health, metrics, nope, wrong_method = parse_responses(await exchange(proxy.port, raw))
    assert (
        health.status == 200 and health.json()["ok"] is True and health.json()["backend"] == "fake"
    )
    text = metrics.body.decode()
    assert 'star_proxy_requests_total{route="/v1/completions",status="200"} 2.0' in text
    assert "star_proxy_tokens_relayed_total 4.0" in text
    assert "star_proxy_ttft_seconds_count 2.0" in text
    assert "star_proxy_inter_token_seconds_count 2.0" in text
    assert "star_proxy_active_streams 0.0" in text
    assert nope.status == 404 and nope.json()["error"]["code"] == "not_found"
    assert wrong_method.status == 405 and wrong_method.headers["allow"] == "POST"
    proxy.backend.ok = False
    (sick,) = parse_responses(
        await exchange(proxy.port, request_bytes("GET", "/health", headers={"connection": "close"}))
    )
    assert sick.status == 503 and sick.json()["ok"] is False


async def test_graceful_shutdown_lets_streams_finish(make_proxy: ProxyFactory) -> None:
    proxy = await make_proxy(Script(text=ANSWER, delay_s=0.01))
    async with client(proxy) as c:
        stream = await c.completions.create(model="tiny", prompt="x", max_tokens=100, stream=True)
        first = await anext(aiter(stream))
        shutdown = asyncio.create_task(proxy.server.shutdown(timeout_s=120))
        rest = [ch async for ch in stream]
    await shutdown
    text = first.choices[0].text + "".join(ch.choices[0].text for ch in rest if ch.choices)
    assert text == ANSWER
    assert proxy.backend.calls[0].outcome == "finished"


def test_runs_under_uvloop(card: ModelCard, tokenizer: Tokenizer) -> None:
    """Production runs on uvloop, whose transports are not asyncio.Transport subclasses."""
    import uvloop

    async def scenario() -> tuple[list, list[str]]:
        settings = ProxySettings(host="127.0.0.1", port=0)
        app = ProxyApp(FakeBackend(tokenizer, Script(text=ANSWER)), [card], settings)
        server = create_server(app, settings)
        await server.start()
        try:
            payload = {"model": "tiny", "prompt": "x", "stream": True, "max_tokens": 100}
            raw = request_bytes("POST", "/v1/completions", payload, {"connection": "close"})
            responses = parse_responses(await exchange(server.port, raw))
            texts = [
                json.loads(e.data)["choices"][0]["text"]
                for e in sse.SSEDecoder().feed(responses[0].body)
                if e.data != "[DONE]"
            ]
            return responses, texts
        finally:
            await server.shutdown(timeout_s=1)

    responses, texts = uvloop.run(scenario())
    assert [r.status for r in responses] == [200]
    assert "".join(texts) == ANSWER


TINY = Path(__file__).resolve().parents[2] / "star" / "model" / "tiny"


@pytest.mark.skipif(not (TINY / "tokenizer.json").is_file(), reason="tiny demo model not built")
def test_the_tiny_demo_model_loads_and_renders_chat() -> None:
    tiny = ModelCard.load(TINY, name="tiny")
    ids = tiny.encode_chat([{"role": "user", "content": "hi"}])
    text = tiny.tokenizer.decode(ids, skip_special_tokens=False)
    assert "hi" in text and text.endswith("assistant\n")
    assert tiny.max_model_len > 0


@pytest.mark.parametrize(
    ("path", "exposes"), [("/health", b"active_streams"), ("/metrics", b"star_proxy_")]
)
async def test_protect_metrics_puts_health_and_metrics_behind_the_key(
    make_proxy: ProxyFactory, path: str, exposes: bytes
) -> None:
    async def get(proxy: Proxy, **headers: str) -> RawResponse:
        raw = request_bytes("GET", path, headers={"connection": "close", **headers})
        (resp,) = parse_responses(await exchange(proxy.port, raw))
        return resp

    proxy = await make_proxy(api_key="sekrit", protect_metrics=True)
    missing, wrong = await get(proxy), await get(proxy, authorization="Bearer nope")
    for resp in (missing, wrong):
        assert resp.status == 401
        assert resp.headers["www-authenticate"] == "Bearer"
        assert exposes not in resp.body
    right = await get(proxy, authorization="Bearer sekrit")
    assert right.status == 200 and exposes in right.body
    # Unprotected (the default), the same probe needs no key.
    assert (await get(await make_proxy(api_key="sekrit"))).status == 200


async def test_a_stream_asking_too_many_logprobs_gets_the_error_inside_it(
    make_proxy: ProxyFactory,
) -> None:
    # As vLLM's server: the engine's check comes after the 200; the backend never sees it.
    proxy = await make_proxy(Script(text=ANSWER))
    body = {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "logprobs": True}
    (streamed,) = await post(
        proxy, "/v1/chat/completions", {**body, "top_logprobs": 30, "stream": True}
    )
    assert streamed.status == 200
    events = [e.data for e in sse.SSEDecoder().feed(streamed.body)]
    assert len(events) == 2 and events[-1] == "[DONE]"
    error = json.loads(events[0])["error"]
    assert error["type"] == "BadRequestError"
    assert error["message"].endswith("which is greater than max allowed: 20")
    (whole,) = await post(proxy, "/v1/chat/completions", {**body, "top_logprobs": 30})
    assert whole.status == 400 and whole.json()["error"]["message"] == error["message"]
    assert proxy.backend.calls == []
