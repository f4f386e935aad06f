"""Steady greedy load through the proxy, and what each client got against a reference.

Every stream is a greedy ``ignore_eos`` completion of a fixed length, so an
unfaulted run of the same prompts is the reference text of each client. A
faulted stream is compared token by token: both texts are tokenized with
the model's tokenizer and aligned (:class:`difflib.SequenceMatcher`), so a
token the client never got counts as lost, one it got twice (or a token
that is not the reference's) as duplicated. A stream that ends with an SSE
error event ended with a clear error (what it did get must still be a
prefix of the reference); one whose connection closed without ``[DONE]`` or
an error was cut. A resuming client (``resume``) that is cut asks the
proxies in turn for the rest after the last event id it got
(``GET /v1/streams/{id}``, docs/operations.md "Resuming a stream") and is
judged on the whole text; one that got no response at all (its proxy died
between taking the request and its first event: no id to resume from) sends
it again to the next proxy, as the openai SDK's ``max_retries`` does with a
connection error before a response.
"""

from __future__ import annotations

import asyncio
import difflib
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from benchmarks.chaos.fleet import MODEL
from benchmarks.client import payload

SSE = {"accept": "text/event-stream"}  # proxy.app.wants_event_ids
RETRIES = 2  # the openai SDK's default max_retries

WORDS = "river lantern copper meadow falcon quartz harbor ember violet canyon".split()


def prompts(n: int) -> list[str]:
    """``n`` distinct prompts (distinct texts: no two clients share a reference)."""
    return [
        f"Story {i}: the {WORDS[i % 10]} and the {WORDS[(i // 10 + 3) % 10]} met at dawn"
        for i in range(n)
    ]


@dataclass
class Stream:
    """What one client received."""

    prompt: str
    text: str = ""
    chunks: int = 0
    done: bool = False  # saw [DONE]
    error: str = ""  # an SSE error event, or a non-200 answer
    cut: str = ""  # the connection ended without [DONE] or an error
    request_id: str = ""
    responded: bool = False  # a status line came back
    retried: int = 0  # sent again after no response at all
    started: float = 0.0
    first_token: float | None = None
    times: list[float] = field(default_factory=list)
    last_id: str = ""  # the SSE id of the last event received
    resumes: int = 0  # times the stream was resumed after a cut
    # Each resume tried: where, how long after the cut, what it gave (the failure's story).
    attempts: list[str] = field(default_factory=list)

    @property
    def outcome(self) -> str:
        if self.error:
            return "error"
        if self.cut or not self.done:
            return "cut"
        return "ok"


async def stream(
    client: httpx.AsyncClient,
    url: str,
    prompt: str,
    max_tokens: int,
    resume: list[str] | None = None,
    resume_within_s: float = 90.0,
) -> Stream:
    """One streamed greedy completion; never raises (what went wrong is in the result).

    ``resume``: proxies to resume on after a cut, tried in turn (each again
    after a pause) for ``resume_within_s``; None: a cut ends the stream.
    """
    out = Stream(prompt, started=time.monotonic())
    body = payload(
        "completions", MODEL, prompt, max_tokens, {"temperature": 0.0, "ignore_eos": True}
    )
    await _read(client, "POST", url + "/v1/completions", body, out)
    for proxy in (resume or [])[:RETRIES]:
        if not out.cut or out.responded:
            break
        out.attempts.append(f"{url}: no response ({out.cut[:80]}), sent again to {proxy}")
        out.cut, out.retried = "", out.retried + 1
        url = proxy
        await _read(client, "POST", url + "/v1/completions", body, out)
    if resume and out.cut and out.last_id:
        cut_at = time.monotonic()
        until = cut_at + resume_within_s
        attempt = 0
        while out.cut and time.monotonic() < until:
            proxy = resume[attempt % len(resume)]
            target = proxy + "/v1/streams/" + out.last_id
            attempt += 1
            cut, out.cut = out.cut, ""
            chunks = out.chunks
            await _read(client, "GET", target, None, out)
            said = out.error or out.cut or "done"
            out.attempts.append(
                f"{proxy} +{time.monotonic() - cut_at:.1f}s {out.chunks - chunks} chunks: {said[:120]}"
            )
            if out.error.startswith("HTTP "):  # not served there (yet): the next proxy
                out.error, out.cut = "", cut
                await asyncio.sleep(0.5)
            elif not out.cut:
                out.resumes += 1
            elif out.cut.startswith(("ConnectError", "ConnectTimeout")):
                await asyncio.sleep(0.5)  # that proxy is down
            else:
                out.resumes += 1  # cut again after some events: resume again
    return out


async def _read(client: httpx.AsyncClient, method: str, url: str, body: Any, out: Stream) -> None:
    """Read one response of a stream into ``out`` (error, cut or done set there)."""
    try:
        # An SSE client (accept: text/event-stream): its events carry ids to resume from.
        async with client.stream(method, url, json=body, headers=SSE) as resp:
            out.responded = True
            if resp.status_code != 200:
                out.error = f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"
                return
            async for line in resp.aiter_lines():
                if line.startswith("id: "):
                    out.last_id = line[4:]
                    continue
                if line == "data: [DONE]":
                    out.done = True
                    continue
                if not line.startswith("data: "):
                    continue
                doc = json.loads(line[6:])
                if "error" in doc:
                    out.error = json.dumps(doc["error"])[:300]
                    continue
                out.request_id = doc.get("id", out.request_id)
                for choice in doc.get("choices", []):
                    piece = choice.get("text") or ""
                    if piece:
                        now = time.monotonic()
                        out.first_token = out.first_token or now
                        out.times.append(now)
                        out.text += piece
                        out.chunks += 1
    except (httpx.HTTPError, OSError) as exc:
        out.cut = f"{type(exc).__name__}: {exc}"[:300]
    if not out.done and not out.error and not out.cut:
        out.cut = "closed without [DONE]"


async def run_load(
    urls: list[str],
    texts: list[str],
    max_tokens: int,
    spread_s: float = 1.0,
    timeout_s: float = 180.0,
    resume: bool = False,
) -> list[Stream]:
    """Every prompt streamed at once (starts spread over ``spread_s``), client i through
    proxy ``urls[i % len(urls)]`` (a load balancer's spread); ``resume``: a cut client
    resumes on the next proxy, then the others in turn."""
    limits = httpx.Limits(max_connections=len(texts) + 8, max_keepalive_connections=0)
    timeout = httpx.Timeout(timeout_s, connect=10.0)
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:

        async def one(i: int, text: str) -> Stream:
            await asyncio.sleep(spread_s * i / max(len(texts), 1))
            first = i % len(urls)
            others = urls[first + 1 :] + urls[: first + 1] if resume else None
            return await stream(client, urls[first], text, max_tokens, others)

        return list(await asyncio.gather(*(one(i, t) for i, t in enumerate(texts))))


class Tokens:
    """The model's tokenizer (``tokenizers``), for counting tokens by index."""

    def __init__(self, model_dir: Path) -> None:
        from tokenizers import Tokenizer

        self._tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))

    def ids(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def text(self, ids: list[int]) -> str:
        return str(self._tok.decode(ids))


@dataclass(frozen=True)
class Compared:
    lost: int  # reference tokens the client never got (before its stream ended)
    duplicated: int  # tokens the client got that the reference does not have there
    complete: bool  # the client's text is the reference's


def compare(tokens: Tokens, got: Stream, ref: str) -> Compared:
    """``got`` against the reference text ``ref``, token by token.

    A stream that ended early (error or cut) is compared with the reference
    cut to what it got: tokens it never received after its end are not lost,
    the client knows its stream ended.
    """
    a, b = tokens.ids(ref), tokens.ids(got.text)
    if got.outcome != "ok":
        a = a[: len(b)]
    lost = duplicated = 0
    for op, i1, i2, j1, j2 in difflib.SequenceMatcher(None, a, b, autojunk=False).get_opcodes():
        if op in ("delete", "replace"):
            lost += i2 - i1
        if op in ("insert", "replace"):
            duplicated += j2 - j1
    return Compared(lost, duplicated, got.text == ref)


async def stream_any(
    client: httpx.AsyncClient, urls: list[str], prompt: str, max_tokens: int
) -> Stream:
    """One stream through the first proxy that takes it, as a load balancer that skips a
    proxy refusing connections would; what the last one tried gave if none did."""
    got = Stream(prompt, cut="no proxy")
    for url in urls:
        got = await stream(client, url, prompt, max_tokens)
        if got.outcome == "ok" or got.chunks:
            return got  # served, or cut mid-stream: not the balancer's to retry
    return got


def summary(streams: list[Stream], refs: dict[str, str], tokens: Tokens) -> dict[str, Any]:
    """Counts over one load: outcomes, tokens lost and duplicated, wrong texts."""
    out: dict[str, Any] = {"streams": len(streams), "ok": 0, "error": 0, "cut": 0}
    out.update(lost=0, duplicated=0, wrong=0)
    examples: list[str] = []
    for s in streams:
        out[s.outcome] += 1
        c = compare(tokens, s, refs[s.prompt])
        out["lost"] += c.lost
        out["duplicated"] += c.duplicated
        if s.outcome == "ok" and not c.complete:
            out["wrong"] += 1
        if s.outcome != "ok" and len(examples) < 3:
            tried = (
                f" (resumes: {'; '.join(s.attempts[:3] + s.attempts[-3:])})" if s.attempts else ""
            )
            examples.append(f"{s.request_id or '?'}: {s.error or s.cut}{tried}")
    out["examples"] = examples
    if any(s.resumes for s in streams):
        out["resumed"] = sum(1 for s in streams if s.resumes)
    if any(s.retried for s in streams):
        out["retried"] = sum(1 for s in streams if s.retried)
    return out
