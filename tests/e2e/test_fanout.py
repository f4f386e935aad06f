"""n > 1, batched prompts and echo through the openai SDK on a real cluster (issue 28).

The proxy fans such a request out into one ordinary request per choice; with
greedy sampling each choice must be the text a single request gives, in the
structure vLLM's server returns (indices, usage, role chunks first); with a
seed, child i must be the single request seeded ``seed + i``, as vLLM seeds
its children. A client that goes away frees every child's KV.
"""

from __future__ import annotations

import socket
import time
from typing import Any

import openai
import pytest

from proxy.tokenizer import ModelCard
from star.fleet import LocalCluster
from star.model import tiny_model_path
from star.model.task import Prompt
from tests.e2e.conftest import DECODE, latest_reports
from tests.proxy.rawhttp import request_bytes

pytestmark = [pytest.mark.engine, pytest.mark.timeout(900)]

MODEL = "star-tiny"
PROMPTS = ["give me a tiny list of colors starting with teal.", "name three fruits, plum first."]
TOKENS = 32
# vLLM 0.32 refuses greedy n > 1 (temperature 0); top_k 1 samples the greedy tokens.
GREEDY_N: dict[str, Any] = {"temperature": 1.0, "extra_body": {"top_k": 1}}


@pytest.fixture(scope="module")
def card() -> ModelCard:
    return ModelCard.load(tiny_model_path(), MODEL)


def sdk(cluster: LocalCluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{cluster.url}/v1", api_key="unused", max_retries=0, timeout=300)


def single(c: openai.OpenAI, prompt: Any, **kw: Any) -> tuple[str, str | None, int]:
    """Text, finish reason and completion tokens of one plain request."""
    resp = c.completions.create(model=MODEL, prompt=prompt, max_tokens=TOKENS, **kw)
    (choice,) = resp.choices
    assert resp.usage is not None
    return choice.text, choice.finish_reason, resp.usage.completion_tokens


def streamed(chunks: list[Any]) -> dict[int, str]:
    """Each choice's text, put together from its chunks."""
    out: dict[int, str] = {}
    for ch in chunks:
        for choice in ch.choices:
            out[choice.index] = out.get(choice.index, "") + choice.text
    return out


def test_n_choices_are_single_greedy_requests(cluster: LocalCluster, card: ModelCard) -> None:
    c = sdk(cluster)
    text, finish, tokens = single(c, PROMPTS[0], temperature=0)
    with pytest.raises(openai.BadRequestError, match="n must be 1 when using greedy sampling"):
        c.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=TOKENS, temperature=0, n=2)
    resp = c.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=TOKENS, n=2, **GREEDY_N)
    assert [ch.index for ch in resp.choices] == [0, 1]
    assert [ch.text for ch in resp.choices] == [text, text] != ["", ""]
    assert [ch.finish_reason for ch in resp.choices] == [finish, finish]
    assert resp.usage is not None and resp.usage.completion_tokens == 2 * tokens
    assert resp.usage.prompt_tokens == len(card.encode(PROMPTS[0]))

    messages: Any = Prompt(topic="animals", size="short", start="owl").messages()
    ref = c.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=TOKENS, temperature=0
    )
    chunks = list(
        c.chat.completions.create(
            model=MODEL,
            messages=messages,
            max_tokens=TOKENS,
            n=2,
            stream=True,
            stream_options={"include_usage": True},
            **GREEDY_N,
        )
    )
    assert [(ch.choices[0].index, ch.choices[0].delta.role) for ch in chunks[:2]] == [
        (0, "assistant"),
        (1, "assistant"),
    ]
    content: dict[int, str] = {}
    for ch in chunks[2:-1]:
        (choice,) = ch.choices
        content[choice.index] = content.get(choice.index, "") + (choice.delta.content or "")
    assert content == {0: ref.choices[0].message.content, 1: ref.choices[0].message.content}
    assert chunks[-1].choices == [] and chunks[-1].usage is not None and ref.usage is not None
    assert chunks[-1].usage.prompt_tokens == ref.usage.prompt_tokens
    assert chunks[-1].usage.completion_tokens == 2 * ref.usage.completion_tokens


def test_seeded_children_are_the_single_requests_vllm_would_seed(cluster: LocalCluster) -> None:
    c = sdk(cluster)
    seeded = {"temperature": 1.0, "seed": 1234}
    refs = [single(c, PROMPTS[1], temperature=1.0, seed=1234 + i)[0] for i in range(2)]
    resp = c.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=TOKENS, n=2, **seeded)
    assert [ch.text for ch in resp.choices] == refs
    assert refs[0] != refs[1]  # the seeds differ, so do the samples


def test_batched_prompts_streamed_and_not(cluster: LocalCluster, card: ModelCard) -> None:
    c = sdk(cluster)
    refs = [single(c, p, temperature=0) for p in PROMPTS]
    resp = c.completions.create(model=MODEL, prompt=PROMPTS, max_tokens=TOKENS, n=2, **GREEDY_N)
    assert [ch.index for ch in resp.choices] == [0, 1, 2, 3]  # prompt_index * n + i
    assert [ch.text for ch in resp.choices] == [refs[k // 2][0] for k in range(4)]
    assert resp.usage is not None
    assert resp.usage.prompt_tokens == sum(len(card.encode(p)) for p in PROMPTS)
    assert resp.usage.completion_tokens == 2 * sum(r[2] for r in refs)

    ids = [card.encode(p) for p in PROMPTS]
    chunks = list(
        c.completions.create(
            model=MODEL,
            prompt=ids,
            max_tokens=TOKENS,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert all(len(ch.choices) == 1 for ch in chunks[:-1])
    assert streamed(chunks[:-1]) == {0: refs[0][0], 1: refs[1][0]}
    assert chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == sum(r[2] for r in refs)


def test_echo_puts_the_prompt_in_front(cluster: LocalCluster, card: ModelCard) -> None:
    c = sdk(cluster)
    refs = [single(c, p, temperature=0)[0] for p in PROMPTS]
    text = refs[0]
    resp = c.completions.create(
        model=MODEL, prompt=PROMPTS[0], max_tokens=TOKENS, temperature=0, echo=True
    )
    assert resp.choices[0].text == PROMPTS[0] + text
    alone = c.completions.create(
        model=MODEL, prompt=PROMPTS[0], max_tokens=0, temperature=0, echo=True
    )
    assert (alone.choices[0].text, alone.choices[0].finish_reason) == (PROMPTS[0], "length")
    assert alone.usage is not None and alone.usage.completion_tokens == 1  # as vLLM counts it
    ids = card.encode(PROMPTS[0])
    resp = c.completions.create(
        model=MODEL, prompt=ids, max_tokens=TOKENS, temperature=0, echo=True
    )
    assert resp.choices[0].text == card.tokenizer.decode(ids, skip_special_tokens=False) + text
    chunks = list(
        c.completions.create(
            model=MODEL,
            prompt=PROMPTS,
            max_tokens=TOKENS,
            echo=True,
            n=2,
            stream=True,
            **GREEDY_N,
        )
    )
    texts = streamed(chunks)
    first = {}
    for ch in chunks:
        first.setdefault(ch.choices[0].index, ch.choices[0].text)
    for k in range(4):
        assert first[k].startswith(PROMPTS[k // 2])
        assert texts[k] == PROMPTS[k // 2] + refs[k // 2]


def _decode_state(cluster: LocalCluster) -> tuple[int, int]:
    """Requests and KV tokens held on the decode instances (DECODE reports expected)."""
    reports = [r for r in latest_reports(cluster).values() if r.role == "decode"]
    if len(reports) != DECODE:
        return -1, -1
    return sum(len(r.requests) for r in reports), sum(r.used_tokens for r in reports)


def _wait(predicate: Any, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.25)


def test_a_disconnected_client_frees_every_child(cluster: LocalCluster) -> None:
    _wait(lambda: _decode_state(cluster) == (0, 0), 180, "idle decode workers before the test")
    body = {
        "model": MODEL,
        "prompt": PROMPTS,
        "n": 2,
        "max_tokens": 3000,
        "ignore_eos": True,
        "temperature": 1.0,
        "top_k": 1,
        "stream": True,
    }
    sock = socket.create_connection(("127.0.0.1", cluster.port), timeout=120)
    try:
        sock.sendall(request_bytes("POST", "/v1/completions", body))
        got = b""
        while got.count(b"data: ") < 8:
            chunk = sock.recv(65536)
            assert chunk, got[-500:]
            got += chunk
        _wait(lambda: _decode_state(cluster)[0] == 4, 180, "the 4 children on the decode workers")
    finally:
        sock.close()
    _wait(lambda: _decode_state(cluster) == (0, 0), 180, "every child's KV to be freed")
