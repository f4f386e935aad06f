"""A cut stream resumed on a real cluster (issue 26 item 1, same proxy).

A proxy of its own (an API key, a short ``proxy.resume_grace_s``) in front of
the package's workers. A client cut mid-stream resumes twice, by the plain
resume path (curl's way) and by ``Last-Event-ID`` (EventSource's): the text,
the token count and the logprobs equal an unbroken greedy run's (each choice's
for a batched, seeded request with n = 2; an echo's prompt logprobs too). A
forged tag and a wrong key are refused; a stream nobody resumes is aborted after the grace and its
KV freed on the worker.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from benchmarks.conformance import differences
from proxy import sse
from star.fleet import LocalCluster
from star.model.task import Prompt
from tests.e2e.conftest import latest_reports
from tests.e2e.streams import SSE, events, logprobs, texts, usage
from tests.procs import proxy_process

pytestmark = [pytest.mark.engine, pytest.mark.timeout(900)]

MODEL = "star-tiny"
KEY = "sekrit"
GRACE_S = 4.0
ORPHAN_GRACE_S = 30.0  # worker.orphan_grace_s, the default the package's workers run with
SEEDED = {"temperature": 1.0, "seed": 11}  # n > 1 is not greedy (vLLM); child k: seed + k


def _decode_requests(cluster: LocalCluster) -> tuple[int, int]:
    reports = [r for r in latest_reports(cluster).values() if r.role == "decode"]
    return sum(len(r.requests) for r in reports), sum(r.used_tokens for r in reports)


def _choices(body: dict[str, Any]) -> int:
    """The choices a request asks for: ``n`` for each of its prompts."""
    prompt = body.get("prompt")
    return int(body.get("n", 1)) * (len(prompt) if isinstance(prompt, list) else 1)


def _wait(predicate: Any, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.25)


def test_a_cut_stream_resumes_exactly_and_an_abandoned_one_is_freed(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    env = {
        **cluster.env,
        "STAR_PROXY_API_KEY": KEY,
        "STAR_PROXY_RESUME_GRACE_S": str(GRACE_S),
        "STAR_LOG_FORMAT": "json",
    }
    with contextlib.ExitStack() as stack:
        proxy = stack.enter_context(proxy_process(env, tmp_path / "proxy.log"))
        proxy.wait(
            lambda: len((proxy.health(KEY) or {}).get("decode", [])) == 2, "both decode", 300
        )
        c = httpx.Client(
            base_url=proxy.url, headers={"authorization": f"Bearer {KEY}", **SSE}, timeout=300
        )
        stack.enter_context(c)
        prompt = Prompt(topic="fruits", size="medium", start="plum")
        common = {
            "model": MODEL,
            "max_tokens": 64,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        colors = {**common, "prompt": "give me a tiny list of colors, teal first."}
        for path, body in (
            ("/v1/completions", colors),
            ("/v1/chat/completions", {**common, "messages": prompt.messages()}),
            ("/v1/completions", {**colors, "logprobs": 2}),  # each token's logprobs once
            ("/v1/completions", {**colors, "logprobs": 2, "echo": True}),  # the prompt's too
            # two prompts, n = 2 (seeded): four upstream requests, each resumed at its position
            (
                "/v1/completions",
                {**colors, "prompt": [colors["prompt"], "count to five"], "n": 2, **SEEDED},
            ),
        ):
            with c.stream("POST", path, json=body) as resp:
                whole = events(resp)
            with c.stream("POST", path, json=body) as resp:
                first = events(resp, 6)  # then the client is cut
            assert first, (body, resp.status_code, whole[:2])
            time.sleep(0.5)  # the request decodes on meanwhile
            with c.stream("GET", f"/v1/streams/{first[-1].id}") as resp:
                assert resp.status_code == 200, resp.read()
                second = events(resp, 8)
            request_id = (first[-1].id or "").split(".")[0]
            last = {"last-event-id": second[-1].id or ""}
            with c.stream("GET", f"/v1/streams/{request_id}", headers=last) as resp:
                third = events(resp)
            assert texts(first + second + third) == texts(whole)
            assert "" not in texts(whole).values()
            assert len(texts(whole)) == _choices(body)
            assert usage(first + second + third) == usage(whole)
            assert (first + second + third)[-1].data == sse.DONE_DATA
            scored = logprobs(first + second + third)
            diffs = differences(scored, logprobs(whole), 1e-4)  # tokens exact, values within 1e-4
            assert not diffs, diffs
            assert bool(scored) == ("logprobs" in body)

        # Refused: a forged tag, a wrong key; then a stream nobody resumes is freed.
        _wait(lambda: _decode_requests(cluster) == (0, 0), 180, "idle decode workers")
        long = {**common, "prompt": "count", "max_tokens": 3000, "ignore_eos": True}
        with c.stream("POST", "/v1/completions", json=long) as resp:
            cut = events(resp, 3)
        good = cut[-1].id or ""
        forged = good[:-4] + ("AAAA" if not good.endswith("AAAA") else "BBBB")
        assert c.get(f"/v1/streams/{forged}").status_code == 403
        wrong = c.get(f"/v1/streams/{good}", headers={"authorization": "Bearer nope"})
        assert wrong.status_code == 401
        held_at = time.monotonic()
        _wait(lambda: _decode_requests(cluster)[0] == 1, 60, "the held request on a worker")
        # Freed once the grace has run out (reports come every second or so).
        _wait(lambda: _decode_requests(cluster) == (0, 0), GRACE_S + 60, "its KV to be freed")
        assert time.monotonic() - held_at >= GRACE_S - 1.0  # held, not aborted at the cut
        gone = c.get(f"/v1/streams/{good}")
        assert gone.status_code == 404 and gone.json()["error"]["code"] == "stream_not_found"
        log = (tmp_path / "proxy.log").read_text()
        assert '"held_stream_aborted"' in log


def test_a_stream_resumes_on_another_proxy_after_its_proxy_is_killed(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    """Issue 26 item 1 across proxies: SIGKILL the proxy mid-stream, resume on another.

    The decode worker holds the request (worker.orphan_grace_s), the second
    proxy takes it over (Attach) and serves the rest: text and count exact.
    A stream whose client never comes back is aborted on the worker after
    the grace, its KV freed.
    """
    env = {**cluster.env, "STAR_LOG_FORMAT": "json"}  # the cluster's secret: one tag key
    common = {
        "model": MODEL,
        "max_tokens": 160,  # still decoding when its proxy is killed
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    prompt = Prompt(topic="animals", size="medium", start="owl")
    chat = {**common, "messages": prompt.messages()}
    fruits = {**common, "prompt": "name three fruits, plum first."}
    cases = [
        ("/v1/chat/completions", chat),
        ("/v1/completions", fruits),
        # the worker keeps the logprobs of what it generated, for the proxy that takes over
        ("/v1/chat/completions", {**chat, "logprobs": True, "top_logprobs": 2}),
        # an echoed prompt's logprobs came with the first chunk: the rest's taken over
        ("/v1/completions", {**fruits, "echo": True, "logprobs": 2}),
        # two prompts, n = 2: each of the four choices taken over from its worker
        (
            "/v1/completions",
            {**common, "prompt": ["name three fruits, plum first.", "count"], "n": 2, **SEEDED},
        ),
    ]
    with contextlib.ExitStack() as stack:
        b = stack.enter_context(proxy_process(env, tmp_path / "b.log"))
        _ready(b)
        cb = stack.enter_context(httpx.Client(base_url=b.url, timeout=300, headers=SSE))
        for k, (path, body) in enumerate(cases):
            a = stack.enter_context(proxy_process(env, tmp_path / f"a{k}.log"))
            _ready(a)
            with cb.stream("POST", path, json=body) as resp:
                whole = events(resp)
            with (
                httpx.Client(base_url=a.url, timeout=300, headers=SSE) as ca,
                contextlib.suppress(httpx.HTTPError),
            ):
                with ca.stream("POST", path, json=body) as resp:
                    first = events(resp, 5)
                    os.killpg(a.proc.pid, signal.SIGKILL)  # mid-stream: no cleanup runs
            a.proc.wait(30)
            with cb.stream("GET", f"/v1/streams/{first[-1].id}") as resp:
                assert resp.status_code == 200, resp.read()
                rest = events(resp)
            assert texts(first + rest) == texts(whole)
            assert "" not in texts(whole).values() and len(texts(whole)) == _choices(body)
            assert usage(rest) == usage(whole)
            assert rest[-1].data == sse.DONE_DATA
            scored = logprobs(first + rest)
            diffs = differences(scored, logprobs(whole), 1e-4)  # tokens exact, values within 1e-4
            assert not diffs, diffs
            assert bool(scored) == ("logprobs" in body)
        # A request each choice: taken over, or run again if it was still in prefill when
        # its proxy died (no worker held it; CI at bcaf900 got a 404 there).
        log_b = (tmp_path / "b.log").read_text()
        taken = log_b.count('"stream_adopted"') + log_b.count('"stream_choice_restarted"')
        assert taken == sum(_choices(body) for _, body in cases)

        # Nobody comes back: the worker holds the orphan, decoding on, then frees it (after
        # worker.orphan_grace_s, or when it finishes first: the tiny model is fast).
        _wait(lambda: _decode_requests(cluster) == (0, 0), 180, "idle decode workers")
        c = stack.enter_context(proxy_process(env, tmp_path / "c.log"))
        _ready(c)
        long = {**common, "prompt": "count", "max_tokens": 3000, "ignore_eos": True}
        with (
            httpx.Client(base_url=c.url, timeout=300, headers=SSE) as cc,
            contextlib.suppress(httpx.HTTPError),
        ):
            with cc.stream("POST", "/v1/completions", json=long) as resp:
                cut = events(resp, 3)
                os.killpg(c.proc.pid, signal.SIGKILL)
        request_id = json.loads(cut[0].data)["id"]
        # Held and still decoding: a decode report after the kill lists it with more tokens
        # generated than its client saw (each report is at most worker.report_interval_s old).
        seen = _wait_for_growth(cluster, request_id, len(cut), 20.0)
        assert seen, (
            f"the orphan is held, still decoding; decode logs: {_lines(cluster, request_id)}"
        )
        _wait(lambda: _decode_requests(cluster) == (0, 0), ORPHAN_GRACE_S + 60, "its KV freed")
        held = [line for line in _lines(cluster, request_id) if '"request_orphaned"' in line]
        assert held, _lines(cluster, request_id)


def _generated(cluster: LocalCluster, request_id: str) -> int | None:
    """Tokens ``request_id`` has generated as the newest decode reports say (None: not listed)."""
    for report in latest_reports(cluster).values():
        for load in report.requests if report.role == "decode" else ():
            if load.id.startswith(request_id):
                return load.generated
    return None


def _wait_for_growth(cluster: LocalCluster, request_id: str, after: int, timeout_s: float) -> bool:
    """Whether a decode report lists ``request_id`` with more than ``after`` tokens in time."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        generated = _generated(cluster, request_id)
        if generated is not None and generated > after:
            return True
        time.sleep(0.25)
    return False


def _lines(cluster: LocalCluster, request_id: str) -> list[str]:
    """The decode workers' log lines that name ``request_id``."""
    logs = "".join(p.read_text() for p in Path(cluster.run_dir).glob("decode-*.log"))
    return [line for line in logs.splitlines() if request_id in line]


def _ready(proxy: Any) -> None:
    proxy.wait(lambda: len((proxy.health() or {}).get("decode", [])) == 2, "both decode", 300)
