"""``star bench serve``'s pure parts (arrivals, datasets, summary) and its client over a fake transport."""

from __future__ import annotations

import asyncio
import json
import math
from pathlib import Path

import httpx
import numpy as np
import pytest

from benchmarks.client import Timing, payload, stream_once
from benchmarks.serve import (
    Slo,
    arrival_times,
    sharegpt_requests,
    summarize,
    table,
    task_requests,
)


def test_poisson_arrivals() -> None:
    rng = np.random.default_rng(0)
    times = arrival_times(20_000, 4.0, rng)
    gaps = np.diff(times)
    assert times[0] == 0.0 and (gaps >= 0).all()
    assert abs(gaps.mean() - 0.25) < 0.01  # exponential gaps of mean 1/rate
    assert abs(gaps.std() - 0.25) < 0.01  # ... with std = mean (Poisson process)
    assert arrival_times(3, math.inf, rng) == [0.0, 0.0, 0.0]
    assert arrival_times(0, 1.0, rng) == []
    assert arrival_times(5, 2.0, np.random.default_rng(7)) == arrival_times(
        5, 2.0, np.random.default_rng(7)
    )


@pytest.mark.parametrize("rate", [0.0, -1.0, math.nan])
def test_arrivals_reject_bad_rates(rate: float) -> None:
    with pytest.raises(ValueError, match="rate"):
        arrival_times(3, rate, np.random.default_rng(0))


def test_task_requests_are_chat_prompts_of_the_sizes_asked() -> None:
    reqs = task_requests(20, np.random.default_rng(0), ["tiny"], 64)
    assert len(reqs) == 20 and all(r.max_tokens == 64 for r in reqs)
    assert all(isinstance(r.prompt, list) and " tiny" in r.prompt[-1]["content"] for r in reqs)
    with pytest.raises(ValueError, match="gigantic"):
        task_requests(1, np.random.default_rng(0), ["gigantic"], 64)


def test_sharegpt_file(tmp_path: Path) -> None:
    data = [
        {
            "id": "a",
            "conversations": [
                {"from": "human", "value": "hi there"},
                {"from": "gpt", "value": "one two three"},
            ],
        },
        {
            "id": "b",
            "conversations": [
                {"from": "gpt", "value": "starts with gpt"},
                {"from": "human", "value": "x"},
            ],
        },
        {"id": "c", "conversations": [{"from": "human", "value": "only one turn"}]},
        {
            "id": "d",
            "conversations": [
                {"from": "human", "value": "long"},
                {"from": "gpt", "value": "w " * 500},
            ],
        },
        "junk",
    ]
    path = tmp_path / "sg.json"
    path.write_text(json.dumps(data))
    reqs = sharegpt_requests(
        path, 5, np.random.default_rng(0), lambda t: len(t.split()), max_tokens=100
    )
    assert len(reqs) == 5
    assert {r.max_tokens for r in reqs} == {3, 100}  # answer length, capped
    assert {r.prompt[0]["content"] for r in reqs if isinstance(r.prompt, list)} == {
        "hi there",
        "long",
    }
    path.write_text("{}")
    with pytest.raises(ValueError, match="JSON list"):
        sharegpt_requests(path, 1, np.random.default_rng(0), len, 10)
    path.write_text(json.dumps(data[1:3]))
    with pytest.raises(ValueError, match="no conversation"):
        sharegpt_requests(path, 1, np.random.default_rng(0), len, 10)


def test_summary_latencies_and_goodput() -> None:
    timings = [
        Timing(
            ok=True, prompt_tokens=10, output_tokens=11, ttft_s=0.1, e2e_s=1.1, itl_s=[0.1] * 10
        ),  # tpot 100 ms
        Timing(
            ok=True, prompt_tokens=10, output_tokens=5, ttft_s=0.5, e2e_s=0.7, itl_s=[0.05] * 4
        ),  # tpot 50 ms
        Timing(
            ok=True, prompt_tokens=10, output_tokens=1, ttft_s=3.0, e2e_s=3.0
        ),  # one token: no TPOT
        Timing(ok=False, error="HTTP 503: busy"),
    ]
    s = summarize(timings, duration_s=4.0, slo=Slo(ttft_ms=1000, tpot_ms=60))
    assert (s["completed"], s["failed"], s["errors"]) == (3, 1, {"HTTP 503: busy": 1})
    assert s["request_throughput"] == pytest.approx(0.75)
    assert s["output_token_throughput"] == pytest.approx(17 / 4)
    assert s["total_token_throughput"] == pytest.approx(47 / 4)
    assert s["ttft_ms"]["median"] == pytest.approx(500)
    assert s["tpot_ms"]["mean"] == pytest.approx(75)
    assert s["e2e_ms"]["mean"] == pytest.approx(1600)
    # Only the second meets TTFT <= 1 s and TPOT <= 60 ms.
    assert s["goodput"] == pytest.approx(0.25) and s["slo_attainment"] == pytest.approx(0.25)
    text = table(s, "title")
    assert "goodput (req/s, TTFT<=1000ms, TPOT<=60ms)  0.250" in text and "HTTP 503" in text


def test_summary_of_nothing_is_nan_not_an_error() -> None:
    s = summarize([], 1.0, Slo(1, 1))
    assert s["completed"] == 0 and math.isnan(s["ttft_ms"]["mean"])


def test_payload_shapes() -> None:
    chat = payload("chat", "m", "hi", 8, {"temperature": 0})
    assert chat["messages"] == [{"role": "user", "content": "hi"}] and chat["stream_options"] == {
        "include_usage": True
    }
    assert payload("completions", "m", "hi", 8, {})["prompt"] == "hi"
    with pytest.raises(ValueError):
        payload("completions", "m", [{"role": "user", "content": "x"}], 8, {})


def _sse(*events: object) -> bytes:
    return b"".join(
        b"data: " + (e if isinstance(e, bytes) else json.dumps(e).encode()) + b"\n\n"
        for e in events
    )


def _run(body: bytes, status: int = 200) -> Timing:
    async def go() -> Timing:
        transport = httpx.MockTransport(lambda request: httpx.Response(status, content=body))
        async with httpx.AsyncClient(transport=transport, base_url="http://x") as client:
            return await stream_once(client, "/v1/chat/completions", {"model": "m"})

    return asyncio.run(go())


def test_client_times_a_stream() -> None:
    delta = lambda t: {"choices": [{"index": 0, "delta": {"content": t}, "finish_reason": None}]}  # noqa: E731
    body = _sse(
        delta(""),
        delta("a"),
        delta("b"),
        delta("c"),
        {"choices": [], "usage": {"prompt_tokens": 4, "completion_tokens": 3}},
        b"[DONE]",
    )
    t = _run(body)
    assert t.ok and (t.prompt_tokens, t.output_tokens) == (4, 3)
    assert len(t.itl_s) == 2 and 0 < t.ttft_s <= t.e2e_s
    assert t.tpot_s is not None and t.tpot_s >= 0


@pytest.mark.parametrize(
    ("body", "status", "error"),
    [
        (b'{"error": {"message": "no decode instance is up"}}', 503, "HTTP 503"),
        (_sse({"choices": [{"index": 0, "text": "a"}]}), 200, "without data: [DONE]"),
        (_sse({"error": {"message": "boom"}}, b"[DONE]"), 200, "boom"),
        (_sse(b"[DONE]"), 200, "no text"),
    ],
)
def test_client_records_failures(body: bytes, status: int, error: str) -> None:
    t = _run(body, status)
    assert not t.ok and error in t.error and t.tpot_s is None
