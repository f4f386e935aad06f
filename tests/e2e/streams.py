"""A resuming SSE client's helpers for the real-cluster resume tests."""

from __future__ import annotations

import json
from typing import Any

import httpx

from proxy import sse

# An SSE client: its events carry ids (proxy.app.wants_event_ids).
SSE = {"accept": "text/event-stream"}


def events(resp: httpx.Response, limit: int | None = None) -> list[sse.Event]:
    """Up to ``limit`` events of a streamed response (all of them: None)."""
    decoder, got = sse.SSEDecoder(), []
    for chunk in resp.iter_raw():
        got += decoder.feed(chunk)
        if limit is not None and len(got) >= limit:
            return got[:limit]
    return got


def text(got: list[sse.Event]) -> str:
    """The text of a completion's or a chat's chunks, joined."""
    out = []
    for ev in got:
        if ev.data != sse.DONE_DATA:
            for choice in json.loads(ev.data)["choices"]:
                out.append(choice.get("text") or choice.get("delta", {}).get("content") or "")
    return "".join(out)


def texts(got: list[sse.Event]) -> dict[int, str]:
    """Each choice's text, joined (a stream of several choices interleaves them)."""
    out: dict[int, str] = {}
    for ev in got:
        if ev.data != sse.DONE_DATA:
            for choice in json.loads(ev.data)["choices"]:
                piece = choice.get("text") or choice.get("delta", {}).get("content") or ""
                out[choice["index"]] = out.get(choice["index"], "") + piece
    return out


def usage(got: list[sse.Event]) -> dict[str, int]:
    """The usage of the one event that carries it."""
    (found,) = [json.loads(e.data)["usage"] for e in got if '"usage":{' in e.data]
    return dict(found)


def logprobs(got: list[sse.Event]) -> dict[str, list[Any]]:
    """Every chunk's logprobs joined: a completion's four lists, a chat's ``content``."""
    out: dict[str, list[Any]] = {}
    for ev in got:
        if ev.data == sse.DONE_DATA:
            continue
        for choice in json.loads(ev.data)["choices"]:
            for key, values in (choice.get("logprobs") or {}).items():
                out.setdefault(key, []).extend(values or [])
    return out
