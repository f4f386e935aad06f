"""A streaming OpenAI-API client that times one request (``star bench serve``).

:func:`stream_once` POSTs one streaming request to ``/v1/completions`` or
``/v1/chat/completions`` and reads the SSE stream to ``data: [DONE]``,
stamping when the request was sent, when each chunk that carries text
arrived and when the stream ended. The token count is the server's
``usage.completion_tokens`` (``stream_options.include_usage``), so a chunk
that carries several tokens is not miscounted. Errors are recorded in the
result, never raised: a load generator keeps going.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

import httpx


@dataclass(slots=True)
class Timing:
    """What one request measured (seconds from the moment it was sent)."""

    ok: bool
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft_s: float = 0.0  # first chunk with text
    e2e_s: float = 0.0  # last byte of the stream
    itl_s: list[float] = field(default_factory=list)  # gaps between text chunks
    error: str = ""
    request_id: str = ""  # the server's id of the completion (the proxy's request id)

    @property
    def tpot_s(self) -> float | None:
        """Time per output token after the first; None for single-token answers."""
        if not self.ok or self.output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)


def payload(
    endpoint: str,
    model: str,
    prompt: str | list[dict[str, str]],
    max_tokens: int,
    extra: dict[str, Any],
) -> dict[str, Any]:
    """The JSON body of one streaming request (``endpoint``: ``completions`` or ``chat``)."""
    body: dict[str, Any] = {
        "model": model,
        "max_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
        **extra,
    }
    if endpoint == "chat":
        body["messages"] = (
            prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
        )
    else:
        if isinstance(prompt, list):
            raise ValueError("the completions endpoint takes a text prompt, not chat messages")
        body["prompt"] = prompt
    return body


def _text(chunk: dict[str, Any]) -> str:
    choices = chunk.get("choices") or []
    if not choices:
        return ""
    choice = choices[0]
    if "delta" in choice:
        return str(choice["delta"].get("content") or "")
    return str(choice.get("text") or "")


async def stream_once(client: httpx.AsyncClient, url: str, body: dict[str, Any]) -> Timing:
    """Send ``body`` to ``url`` and time the SSE stream (see the module docstring)."""
    start = time.perf_counter()
    last: float | None = None
    timing = Timing(ok=False)
    done = False
    try:
        async with client.stream("POST", url, json=body) as resp:
            if resp.status_code != 200:
                text = (await resp.aread()).decode(errors="replace")
                timing.error = f"HTTP {resp.status_code}: {text[:300]}"
                return timing
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    done = True
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    timing.error = str(chunk["error"].get("message", chunk["error"]))[:300]
                    return timing
                now = time.perf_counter()
                if not timing.request_id:
                    timing.request_id = str(chunk.get("id") or "")
                if _text(chunk):
                    if last is None:
                        timing.ttft_s = now - start
                    else:
                        timing.itl_s.append(now - last)
                    last = now
                usage = chunk.get("usage")
                if usage:
                    timing.prompt_tokens = int(usage.get("prompt_tokens", 0))
                    timing.output_tokens = int(usage.get("completion_tokens", 0))
    except (httpx.HTTPError, ValueError) as exc:
        timing.error = f"{type(exc).__name__}: {exc}"
        return timing
    timing.e2e_s = time.perf_counter() - start
    if not done:
        timing.error = "stream ended without data: [DONE]"
    elif last is None:
        timing.error = "no text in the stream"
    else:
        timing.ok = True
    return timing


__all__ = ["Timing", "payload", "stream_once"]
