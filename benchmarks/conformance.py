"""``star bench conformance``: one table of requests to vLLM's own OpenAI server and to STAR, compared.

Sends the same requests (completions and chat, streamed and not, greedy or
seeded, every parameter vLLM 0.32's server serves that STAR claims, and
invalid ones for the error shapes) to a plain vLLM OpenAI server and to a
STAR fleet on the same model, and compares the responses field by field:
each choice's text (token for token), ``finish_reason`` and ``stop_reason``,
tool calls and reasoning, logprobs (values within ``--tol``, token strings
exactly), usage, and for refusals the HTTP status and the error's ``type``;
and the answers' shapes: every field path either carries (each chunk's of a
stream, the usage chunk's apart), so a field one server writes (``null``
included) and the other leaves out is a difference. Ids, timestamps and
tool-call ids are not compared; neither are error messages' wording. A
streamed response is compared as the whole it puts together (text, logprobs
and tool-call arguments concatenated per choice, the last finish reason, the
usage chunk).

Unless ``--vllm-url`` / ``--star-url`` name running servers, it starts them
one after the other, on the shipped tiny model unless ``--model``: ``python
-m vllm.entrypoints.openai.api_server`` with the engine arguments STAR's
CPU workers use (fp32, eager, the ``uni`` executor, 1 GiB of KV cache, one
OpenMP thread), then a ``star up``-style local fleet (private redis-server,
1 prefill + 2 decode workers, the proxy; no scheduler, so nothing but
``--migrate`` moves a request). Both get vLLM's hermes tool parser with
auto tool choice (``--tool-parser ''``: neither), and with
``--reasoning-parser`` (e.g. ``deepseek_r1``) that reasoning parser and the
rows where it decides (:func:`reasoning_cases`), on the tiny model with the
reasoning markup added unless ``--model``.

``--migrate`` sends every STAR request a second time and moves each of its
sequences (each choice of ``n`` / batched prompts is one) to the other
decode instance mid-request: the decode engines stand still (SIGSTOP) from
the request's dispatch, the source runs a burst (``--burst-ms``) to
decode some tokens, a manual decision is published (what ``star migrate``
publishes), and once the proxy has acted on it every engine runs again.
The tiny model decodes a token in about a millisecond, and on a slow box
the release often reached the engine only after a short request had ended
(one move of 93 landed); so with ``--migrate`` the decode engines' steps
are padded to ``--step-ms`` (20 ms: emulated step time, which changes no
token), within which a release lands, and a burst decodes a known number
of tokens. A burst that still finishes the request before its release has
it sent again with the next, shorter burst (0: the decision lands before
the source's first step). The row's ``migrated`` column is the outcome (resumed after
how many generated tokens, or the reason the proxy refused the move);
every try's response is compared with vLLM's. It needs the fleet this
command starts (it pauses its engine processes).

Also runs as ``python -m benchmarks.conformance``. Exit status 0 when every
row is identical (or refused by both), 1 otherwise.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from benchmarks.common import bench_main, text_table
from star.model.markup import THINK_END

MODEL = "star-tiny"
MAX_TOKENS = 24
P1 = "give me a tiny list of colors starting with teal."
P2 = "name three fruits, plum first."
CHAT = [{"role": "user", "content": "give me a short list of animals starting with owl."}]
SCHEMA = {
    "type": "object",
    "properties": {"color": {"type": "string", "enum": ["teal", "plum", "red"]}},
    "required": ["color"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "the weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
            "required": ["city"],
            "additionalProperties": False,
        },
        "strict": True,
    },
}


@dataclass(frozen=True)
class Case:
    """One request of the table; ``route`` is ``completions`` or ``chat``."""

    name: str
    route: str
    body: dict[str, Any]
    streams: tuple[bool, ...] = (False, True)
    error: bool = False  # an invalid request (its error shape is compared)

    def request(self, model: str, stream: bool) -> dict[str, Any]:
        base: dict[str, Any] = {"model": model, "max_tokens": MAX_TOKENS, "temperature": 0.0}
        base["prompt" if self.route == "completions" else "messages"] = (
            P1 if self.route == "completions" else CHAT
        )
        body = {**base, **self.body}
        body = {k: v for k, v in body.items() if v is not None}
        if stream:
            body["stream"] = True
            body["stream_options"] = {"include_usage": True}
        return body

    def prompts(self) -> int:
        """How many prompts it carries (a batched completion prompt: several)."""
        prompt = self.body.get("prompt", P1)
        batched = isinstance(prompt, list) and prompt and not isinstance(prompt[0], int)
        return len(prompt) if batched else 1

    def sequences(self) -> int:
        """How many engine requests it fans out into (choices)."""
        return self.prompts() * int(self.body.get("n") or 1)


def c(name: str, body: dict[str, Any], **kw: Any) -> Case:
    return Case(name, "completions", body, **kw)


def h(name: str, body: dict[str, Any], **kw: Any) -> Case:
    return Case(name, "chat", body, **kw)


def reasoning_cases() -> list[Case]:
    """Rows where the reasoning decides (``--reasoning-parser``, on the marked-up tiny model).

    A structured-output grammar applies from where the reasoning ends
    (vLLM's ``reasoning_ended``): at once when ``include_reasoning`` is false
    or the prompt already ended it, else after ``</think>``, which the tiny
    model writes only when a logit bias makes it.
    """
    choice = {"structured_outputs": {"choice": ["owl", "cat", "fox"]}}
    regex = {"structured_outputs": {"regex": "(owl|cat)( [a-z]{2,6}){2}"}}
    ended = [*CHAT, {"role": "assistant", "content": "<think>owls first</think>"}]
    return [
        h("reasoning: include_reasoning false", {"include_reasoning": False}),
        h("reasoning: choice, include_reasoning false", {**choice, "include_reasoning": False}),
        h(
            "reasoning: choice, the prompt ends the reasoning",
            {
                **choice,
                "messages": ended,
                "add_generation_prompt": False,
                "continue_final_message": True,
            },
        ),
        h(
            "reasoning: regex after a forced </think>",
            {**regex, "logit_bias": {str(THINK_END): 100.0}},
        ),
    ]


def cases(tools: bool = True, reasoning: bool = False) -> list[Case]:
    """The table: every parameter vLLM's server serves that STAR claims, and error shapes."""
    tool_rows = (
        [
            h("tools, tool_choice auto", {"tools": [WEATHER], "tool_choice": "auto"}),
            h("tools, tool_choice required", {"tools": [WEATHER], "tool_choice": "required"}),
            h(
                "tools, named tool_choice",
                {
                    "tools": [WEATHER],
                    "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
                },
            ),
        ]
        if tools
        else []
    )
    return [
        # -- completions
        c("greedy", {}),
        c("max_tokens=1", {"max_tokens": 1}),
        c("stop", {"stop": ["gold"]}),
        c(
            "stop, include_stop_str_in_output",
            {"stop": ["gold"], "include_stop_str_in_output": True},
        ),
        c("stop_token_ids", {"stop_token_ids": [593]}),
        c("n=2", {"n": 2}),
        c("batched prompts", {"prompt": [P1, P2]}),
        c("batched prompts, n=2", {"prompt": [P1, P2], "n": 2}),
        c("token-id prompt", {"prompt": [40, 41, 42, 43, 44, 45, 46, 47]}),
        c("echo", {"echo": True}),
        c("echo, max_tokens=0", {"echo": True, "max_tokens": 0}),
        c("logprobs=3", {"logprobs": 3}),
        c("logprobs=0", {"logprobs": 0}),
        c("echo + logprobs (prompt logprobs)", {"echo": True, "logprobs": 2}),
        c("prompt_logprobs=2", {"prompt_logprobs": 2}),
        c("seed, temperature 0.8", {"seed": 7, "temperature": 0.8}),
        c("seed, top_p, top_k", {"seed": 11, "temperature": 1.0, "top_p": 0.9, "top_k": 20}),
        c("seed, n=2", {"seed": 5, "temperature": 1.0, "n": 2}),
        c("presence + frequency penalty", {"presence_penalty": 0.8, "frequency_penalty": 0.6}),
        c("repetition_penalty", {"repetition_penalty": 1.3}),
        c("min_tokens", {"min_tokens": 20, "max_tokens": 24}),
        c("bad_words", {"bad_words": [" teal", " a"]}),
        c("ignore_eos", {"ignore_eos": True}),
        c("logit_bias", {"logit_bias": {"60": 5.0, "61": -100}}),
        c("structured outputs: json", {"structured_outputs": {"json": SCHEMA}}),
        c(
            "structured outputs: json, no whitespace",
            {"structured_outputs": {"json": SCHEMA, "disable_any_whitespace": True}},
        ),
        c(
            "structured outputs: regex",
            {"structured_outputs": {"regex": "(teal|plum|red)( [a-z]{2,6}){2}"}},
        ),
        c(
            "structured outputs: choice",
            {"structured_outputs": {"choice": ["teal", "plum", "owl"]}},
        ),
        c(
            "response_format json_schema",
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "c", "schema": SCHEMA},
                }
            },
        ),
        c("best_of=2", {"best_of": 2}),
        c("suffix", {"suffix": "end"}),
        c("return_token_ids", {"return_token_ids": True}),
        c("return_token_ids, echo", {"return_token_ids": True, "echo": True}),
        c("return_token_ids, 2 prompts", {"return_token_ids": True, "prompt": [P1, "crow"]}),
        c("return_tokens_as_token_ids", {"logprobs": 1, "return_tokens_as_token_ids": True}),
        c("truncate_prompt_tokens=5", {"truncate_prompt_tokens": 5}),
        c(
            "truncate_prompt_tokens=3, right",
            {"truncate_prompt_tokens": 3, "truncation_side": "right"},
        ),
        c(
            "truncate_prompt_tokens=-1, a prompt past the context",
            {
                "prompt": "owl " * 5000,
                "truncate_prompt_tokens": -1,
                "max_tokens": 1,
            },
        ),
        # a 3,992-token prompt: 104 tokens of the context left, 200 asked for
        c("add_special_tokens=false", {"add_special_tokens": False}),
        c("return_token_offsets (ignored)", {"return_token_offsets": True}),
        c("watermarking=false", {"watermarking": False}),
        c("error: prompt_embeds (not enabled)", {"prompt_embeds": "AAAA"}, error=True),
        c(
            "spaces_between_special_tokens=false",
            {"spaces_between_special_tokens": False, "skip_special_tokens": False},
        ),
        c(
            "repetition_detection",
            {"repetition_detection": {"max_pattern_size": 4, "min_count": 3}},
        ),
        c("vllm_xargs", {"vllm_xargs": {"unused_by_any_processor": 1}}),
        c("thinking_token_budget=5 (no reasoning parser)", {"thinking_token_budget": 5}),
        c(
            "error: repetition_detection min_count=1",
            {"repetition_detection": {"max_pattern_size": 4, "min_count": 1}},
            error=True,
        ),
        c("max_tokens past the context (clamped)", {"prompt": "owl " * 3990, "max_tokens": 200}),
        c("use_beam_search, n=2", {"use_beam_search": True, "n": 2}),
        c(
            "use_beam_search, n=3, length_penalty=0.5, 2 prompts",
            {"use_beam_search": True, "n": 3, "length_penalty": 0.5, "prompt": [P1, "crow"]},
            streams=(False,),
        ),
        c("error: max_tokens=-1", {"max_tokens": -1}, error=True),
        c("error: unknown model", {"model": "no-such-model"}, error=True),
        c("error: logprobs=21", {"logprobs": 21}, error=True),
        c("error: n=0", {"n": 0}, error=True),
        c("error: temperature=-1", {"temperature": -1.0}, error=True),
        c("error: no prompt", {"prompt": None}, error=True),
        c("error: prompt too long", {"prompt": "owl " * 5000}, error=True),
        c("error: max_tokens past max_model_len", {"max_tokens": 5000}, error=True),
        # -- chat
        h("greedy", {}),
        h("max_completion_tokens", {"max_tokens": None, "max_completion_tokens": 12}),
        h("stop", {"stop": ["crow"]}),
        h("stop_token_ids", {"stop_token_ids": [414]}),
        h("n=2", {"n": 2}),
        h("seed, n=2", {"seed": 5, "temperature": 1.0, "n": 2}),
        h("logprobs, top_logprobs=2", {"logprobs": True, "top_logprobs": 2}),
        h("logprobs, no top_logprobs", {"logprobs": True}),
        h("seed, temperature 0.8", {"seed": 7, "temperature": 0.8}),
        h(
            "penalties (presence, frequency, repetition)",
            {"presence_penalty": 0.5, "frequency_penalty": 0.5, "repetition_penalty": 1.2},
        ),
        h("min_tokens", {"min_tokens": 20}),
        h("bad_words", {"bad_words": [" owl"]}),
        h("ignore_eos", {"ignore_eos": True}),
        h(
            "response_format json_schema",
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "c", "schema": SCHEMA},
                }
            },
        ),
        h("response_format json_object", {"response_format": {"type": "json_object"}}),
        h(
            "structured outputs: regex",
            {"structured_outputs": {"regex": "(owl|cat)( [a-z]{2,6}){2}"}},
        ),
        h("structured outputs: choice", {"structured_outputs": {"choice": ["owl", "cat", "fox"]}}),
        h("tools, tool_choice none", {"tools": [WEATHER], "tool_choice": "none"}),
        *tool_rows,
        h(
            "echo (continue final message)",
            {
                "messages": [*CHAT, {"role": "assistant", "content": "owl, cat"}],
                "echo": True,
                "add_generation_prompt": False,
                "continue_final_message": True,
            },
        ),
        h(
            "continue_final_message",
            {
                "messages": [*CHAT, {"role": "assistant", "content": "owl, cat"}],
                "add_generation_prompt": False,
                "continue_final_message": True,
            },
        ),
        h("prompt_logprobs=1", {"prompt_logprobs": 1}),
        h("reasoning_effort=low", {"reasoning_effort": "low"}),
        h("documents", {"documents": [{"title": "owls", "text": "owls hoot"}]}),
        h("chat_template_kwargs", {"chat_template_kwargs": {"enable_thinking": False}}),
        h("add_special_tokens=true", {"add_special_tokens": True}),
        h("return_prompt_text", {"return_prompt_text": True}),
        h("use_beam_search, n=2", {"use_beam_search": True, "n": 2}),
        h("error: mm_processor_kwargs (untrusted)", {"mm_processor_kwargs": {"a": 1}}, error=True),
        h("return_token_ids", {"return_token_ids": True}),
        h(
            "return_tokens_as_token_ids",
            {"logprobs": True, "top_logprobs": 2, "return_tokens_as_token_ids": True},
        ),
        h("truncate_prompt_tokens=5", {"truncate_prompt_tokens": 5}),
        h("error: a request's chat_template", {"chat_template": "{{ 'x' }}"}, error=True),
        h("error: top_logprobs=30", {"logprobs": True, "top_logprobs": 30}, error=True),
        h("error: no messages", {"messages": None}, error=True),
        h("error: n=0", {"n": 0}, error=True),
        h("error: unknown model", {"model": "no-such-model"}, error=True),
        *(reasoning_cases() if reasoning else []),
    ]


# -- one response, as the whole it puts together -------------------------------------------


@dataclass
class Outcome:
    """What a server answered to one request, in a form both servers' answers share."""

    status: int = 0
    doc: dict[str, Any] = field(default_factory=dict)  # the comparable fields
    # Every field path the answer carried (``choices[].delta.content``; a
    # stream's: those of its chunks, and of its usage chunk apart): its shape.
    fields: set[str] = field(default_factory=set)
    request_ids: list[str] = field(default_factory=list)  # response ids seen (chunks' ``id``)
    error: str = ""  # a transport failure (no answer)

    @property
    def served(self) -> str:
        if self.error:
            return f"failed: {self.error}"
        if self.status != 200:
            return f"{self.status} {self.doc.get('error_type', '')}".strip()
        if "stream_error" in self.doc:
            return f"200, stream error {self.doc['stream_error']}"
        return "served"


def _usage(doc: dict[str, Any] | None) -> dict[str, Any] | None:
    if not doc:
        return None
    return {k: doc.get(k) for k in ("prompt_tokens", "completion_tokens", "total_tokens")}


def _error(status: int, doc: Any) -> dict[str, Any]:
    err = doc.get("error") if isinstance(doc, dict) else None
    if isinstance(err, dict):
        return {"status": status, "error_type": err.get("type"), "message": err.get("message")}
    return {"status": status, "error_type": None, "message": str(doc)[:200]}


def _tool_calls(calls: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    return [
        {
            "type": tc.get("type"),
            "name": (tc.get("function") or {}).get("name"),
            "arguments": (tc.get("function") or {}).get("arguments"),
        }
        for tc in calls or []
    ]


def whole(route: str, doc: dict[str, Any]) -> dict[str, Any]:
    """The comparable fields of a non-streamed response."""
    choices: dict[str, Any] = {}
    for ch in doc.get("choices") or []:
        key = str(ch.get("index"))
        if route == "completions":
            choices[key] = {
                "text": ch.get("text"),
                "finish_reason": ch.get("finish_reason"),
                "stop_reason": ch.get("stop_reason"),
                "logprobs": ch.get("logprobs"),
                "prompt_logprobs": ch.get("prompt_logprobs"),
                "token_ids": ch.get("token_ids"),
                "prompt_token_ids": ch.get("prompt_token_ids"),
            }
        else:
            msg = ch.get("message") or {}
            choices[key] = {
                "role": msg.get("role"),
                "content": msg.get("content"),
                "reasoning": msg.get("reasoning") or msg.get("reasoning_content"),
                "tool_calls": _tool_calls(msg.get("tool_calls")),
                "finish_reason": ch.get("finish_reason"),
                "stop_reason": ch.get("stop_reason"),
                "logprobs": (ch.get("logprobs") or {}).get("content"),
                "token_ids": ch.get("token_ids"),
            }
    out: dict[str, Any] = {
        "object": doc.get("object"),
        "choices": choices,
        "usage": _usage(doc.get("usage")),
    }
    if route == "chat":
        out["prompt_logprobs"] = doc.get("prompt_logprobs")
        out["prompt_token_ids"] = doc.get("prompt_token_ids")
        out["prompt_text"] = doc.get("prompt_text")
    return out


def assembled(route: str, chunks: list[dict[str, Any]]) -> dict[str, Any]:
    """The comparable fields of a stream: each choice put together from its chunks."""
    choices: dict[str, dict[str, Any]] = {}
    usage = None
    objects = sorted({str(ch.get("object")) for ch in chunks})
    prompt_logprobs = prompt_ids = prompt_text = None
    for chunk in chunks:
        if chunk.get("usage"):
            usage = chunk["usage"]
        if route == "chat" and chunk.get("prompt_logprobs") is not None:
            prompt_logprobs = chunk["prompt_logprobs"]
        if route == "chat" and chunk.get("prompt_token_ids") is not None:
            prompt_ids = chunk["prompt_token_ids"]  # every choice's first chunk: the one prompt
        if route == "chat" and chunk.get("prompt_text") is not None:
            prompt_text = chunk["prompt_text"]
        for ch in chunk.get("choices") or []:
            key = str(ch.get("index"))
            if route == "completions":
                cur = choices.setdefault(
                    key,
                    {
                        "text": "",
                        "finish_reason": None,
                        "stop_reason": None,
                        "logprobs": None,
                        "prompt_logprobs": None,
                        "token_ids": None,
                        "prompt_token_ids": None,
                    },
                )
                cur["text"] += ch.get("text") or ""
                if ch.get("prompt_token_ids") is not None:
                    cur["prompt_token_ids"] = ch["prompt_token_ids"]
                lp = ch.get("logprobs")
                if lp is not None:
                    acc = cur["logprobs"] or {
                        "text_offset": [],
                        "token_logprobs": [],
                        "tokens": [],
                        "top_logprobs": [],
                    }
                    for k in acc:
                        acc[k] += lp.get(k) or []
                    cur["logprobs"] = acc
                if ch.get("prompt_logprobs") is not None:
                    cur["prompt_logprobs"] = ch["prompt_logprobs"]
            else:
                cur = choices.setdefault(
                    key,
                    {
                        "role": None,
                        "content": None,
                        "reasoning": None,
                        "tool_calls": [],
                        "finish_reason": None,
                        "stop_reason": None,
                        "logprobs": None,
                        "token_ids": None,
                        "_calls": {},
                    },
                )
                delta = ch.get("delta") or {}
                if delta.get("role"):
                    cur["role"] = delta["role"]
                for name, src in (
                    ("content", "content"),
                    ("reasoning", "reasoning"),
                    ("reasoning", "reasoning_content"),
                ):
                    if delta.get(src):
                        cur[name] = (cur[name] or "") + delta[src]
                for tc in delta.get("tool_calls") or []:
                    call = cur["_calls"].setdefault(
                        tc.get("index", 0), {"type": None, "name": None, "arguments": ""}
                    )
                    call["type"] = tc.get("type") or call["type"]
                    fn = tc.get("function") or {}
                    call["name"] = fn.get("name") or call["name"]
                    call["arguments"] += fn.get("arguments") or ""
                lp = ch.get("logprobs")
                if lp is not None and lp.get("content") is not None:
                    cur["logprobs"] = (cur["logprobs"] or []) + lp["content"]
            if ch.get("token_ids") is not None:  # each chunk its tokens': joined
                cur["token_ids"] = (cur["token_ids"] or []) + ch["token_ids"]
            if ch.get("finish_reason") is not None:
                cur["finish_reason"] = ch["finish_reason"]
            if ch.get("stop_reason") is not None:
                cur["stop_reason"] = ch["stop_reason"]
    for cur in choices.values():
        calls = cur.pop("_calls", None)
        if calls is not None:
            cur["tool_calls"] = [calls[i] for i in sorted(calls)]
    # A non-streamed chat response says content "" where a stream sends no content delta.
    out: dict[str, Any] = {"object": ",".join(objects), "choices": choices, "usage": _usage(usage)}
    if route == "chat":
        out["prompt_logprobs"] = prompt_logprobs
        out["prompt_token_ids"] = prompt_ids
        out["prompt_text"] = prompt_text
    return out


async def send(
    client: httpx.AsyncClient, base: str, case: Case, model: str, stream: bool
) -> Outcome:
    """Send one request of the table to ``base`` and put its answer in :class:`Outcome` form."""
    url = f"{base}/v1/{'completions' if case.route == 'completions' else 'chat/completions'}"
    body = case.request(model, stream)
    out = Outcome()
    try:
        if not stream:
            resp = await client.post(url, json=body)
            out.status = resp.status_code
            try:
                doc = resp.json()
            except ValueError:
                doc = {"error": {"type": None, "message": resp.text[:200]}}
            out.fields = field_paths(doc)
            if resp.status_code != 200:
                out.doc = _error(resp.status_code, doc)
            else:
                out.doc = whole(case.route, doc)
                out.request_ids = [doc.get("id", "")]
            return out
        async with client.stream("POST", url, json=body) as resp:
            out.status = resp.status_code
            if resp.status_code != 200:
                raw = await resp.aread()
                try:
                    doc = json.loads(raw)
                except ValueError:
                    doc = {"error": {"type": None, "message": raw[:200].decode(errors="replace")}}
                out.doc = _error(resp.status_code, doc)
                out.fields = field_paths(doc)
                return out
            chunks: list[dict[str, Any]] = []
            stream_error = None
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                doc = json.loads(line[6:])
                if "error" in doc:
                    stream_error = doc["error"]
                    continue
                chunks.append(doc)
                # The usage chunk (no choices) is a shape of its own.
                out.fields |= field_paths(doc, "usage chunk: " if not doc.get("choices") else "")
                if doc.get("id") and doc["id"] not in out.request_ids:
                    out.request_ids.append(doc["id"])
            out.doc = assembled(case.route, chunks)
            if stream_error is not None:
                out.doc["stream_error"] = (stream_error or {}).get("type")
                out.doc["stream_error_message"] = (stream_error or {}).get("message")
    except httpx.HTTPError as exc:
        out.error = repr(exc)[:200]
    return out


# -- comparison -----------------------------------------------------------------------------

IGNORED = {"message", "stream_error_message"}  # error wording: reported, not compared
# Fields whose values are maps keyed by token text (completions' top_logprobs)
# or free-form: their own keys are not a shape.
_OPAQUE = {"top_logprobs", "prompt_logprobs", "arguments", "parameters", "metrics"}


def field_paths(doc: Any, prefix: str = "") -> set[str]:
    """Every field path of a JSON answer: ``choices[].message.content``; lists as ``[]``."""
    out: set[str] = set()

    def walk(v: Any, path: str) -> None:
        if isinstance(v, dict):
            for k, x in v.items():
                p = f"{path}.{k}" if path else str(k)
                out.add(prefix + p)
                if k not in _OPAQUE:
                    walk(x, p)
        elif isinstance(v, list):
            for x in v:
                walk(x, path + "[]")

    walk(doc, "")
    return out


def shape_differences(a: set[str], b: set[str]) -> list[str]:
    """The fields only one of two answers carried (``a`` vLLM's, ``b`` STAR's)."""
    return [f"field {p} (only in vLLM)" for p in sorted(a - b)] + [
        f"field {p} (only in STAR)" for p in sorted(b - a)
    ]


def differences(a: Any, b: Any, tol: float, path: str = "") -> list[str]:
    """The paths where ``a`` and ``b`` differ (floats within ``tol`` are equal)."""
    if isinstance(a, dict) and isinstance(b, dict):
        out: list[str] = []
        for k in sorted(set(a) | set(b), key=str):
            if k in IGNORED:
                continue
            if k not in a or k not in b:
                out.append(f"{path}.{k} (only in {'STAR' if k in b else 'vLLM'})")
                continue
            out += differences(a[k], b[k], tol, f"{path}.{k}")
        return out
    if isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            return [f"{path} (length {len(a)} vs {len(b)})"]
        out = []
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            out += differences(x, y, tol, f"{path}[{i}]")
        return out
    if isinstance(a, float) or isinstance(b, float):
        if isinstance(a, int | float) and isinstance(b, int | float) and not isinstance(a, bool):
            if math.isclose(a, b, rel_tol=0.0, abs_tol=tol) or a == b:
                return []
        return [f"{path} ({a!r} vs {b!r})"]
    return [] if a == b else [f"{path} ({_short(a)} vs {_short(b)})"]


def _short(v: Any) -> str:
    s = json.dumps(v) if not isinstance(v, str) else repr(v)
    return s if len(s) <= 60 else s[:57] + "..."


@dataclass
class Row:
    case: Case
    stream: bool
    vllm: Outcome
    star: Outcome
    diffs: list[str]
    migrated: str = ""  # --migrate: the outcome of the moves
    migrated_diffs: list[str] | None = None

    @property
    def parameter(self) -> str:
        return f"{self.case.route}: {self.case.name}{' (stream)' if self.stream else ''}"

    @property
    def identical(self) -> bool:
        return not self.diffs and not self.vllm.error and not self.star.error

    def as_json(self) -> dict[str, Any]:
        return {
            "route": self.case.route,
            "parameter": self.case.name,
            "stream": self.stream,
            "request": self.case.request(MODEL, self.stream),
            "vllm": self.vllm.served,
            "star": self.star.served,
            "identical": self.identical,
            "differences": self.diffs,
            "vllm_response": self.vllm.doc,
            "star_response": self.star.doc,
            "migrated": self.migrated or None,
            "migrated_differences": self.migrated_diffs,
        }


# -- forcing a migration mid-request (--migrate) ---------------------------------------------


class Migrator:
    """Moves each sequence of a STAR request to the other decode instance mid-request.

    The decode engines stand still (SIGSTOP) from before the request is sent;
    each dispatched sequence's source runs ``burst_s`` (some tokens), stops,
    a manual decision is published, and once the proxy acted on every one
    (``migrating`` or ``refused``) all engines run again.
    """

    def __init__(self, fleet: Any, bus: Any, decode: Sequence[str]) -> None:
        self.fleet = fleet
        self.bus = bus
        self.decode = list(decode)

    def engine_pids(self, name: str) -> list[int]:
        from star.fleet import group_members

        leader = self.fleet.pids()[name]
        return [pid for pid, _g, _n in group_members({leader}) if pid != leader]

    @staticmethod
    def signal(pids: Sequence[int], sig: int) -> None:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)

    @contextlib.contextmanager
    def all_paused(self) -> Iterator[dict[str, list[int]]]:
        pids = {name: self.engine_pids(name) for name in self.decode}
        try:
            for p in pids.values():
                self.signal(p, signal.SIGSTOP)
            yield pids
        finally:
            for p in pids.values():
                self.signal(p, signal.SIGCONT)

    async def run(
        self,
        client: httpx.AsyncClient,
        base: str,
        case: Case,
        model: str,
        stream: bool,
        burst_s: float,
    ) -> tuple[Outcome, str, bool]:
        """The response to ``case`` with each sequence moved once, what happened to the moves,
        and whether every move settled (resumed or refused: not overtaken by the request's end)."""
        from star.bus import Subscriber
        from star.fleet import manual_decision
        from star.wire import Event, EventKind

        sub = Subscriber(self.bus, "events", Event, start=await self.bus.last_id("events"))
        expected = case.sequences()
        moves: dict[str, str] = {}  # request -> outcome
        with self.all_paused() as pids:
            task = asyncio.create_task(send(client, base, case, model, stream))
            deadline = time.monotonic() + 120
            dispatched: list[tuple[str, str]] = []
            while len(dispatched) < expected and not task.done() and time.monotonic() < deadline:
                for entry in await sub.read(block_ms=100):
                    ev = entry.msg
                    if (
                        isinstance(ev, Event)
                        and ev.event is EventKind.DISPATCHED
                        and ev.instance in self.decode
                        and all(r != ev.request for r, _ in dispatched)
                    ):
                        dispatched.append((ev.request, ev.instance))
            for request, source in dispatched:
                target = next(n for n in self.decode if n != source)
                self.signal(pids[source], signal.SIGCONT)
                await asyncio.sleep(burst_s)
                self.signal(pids[source], signal.SIGSTOP)
                decision = manual_decision(request, source, target)
                await self.bus.publish("decisions", decision)
                moves[request] = await self._acted(request, decision.id)
        out = await asyncio.wait_for(task, 600)
        # A one-prompt request's prompt length: what a sequence had generated at its release.
        prompt = (out.doc.get("usage") or {}).get("prompt_tokens") if case.prompts() == 1 else None
        # Each accepted move: resumed on the target, or how it ended.
        after: list[str] = []
        for request, what in list(moves.items()):
            if what != "migrating":
                continue
            events = await self._events_until_finished(request)
            kinds = [e.event for e in events]
            released = next((e for e in events if e.event is EventKind.RELEASED), None)
            if EventKind.RESUMED in kinds:
                moves[request] = "resumed"
                if released is not None:
                    tokens = int(released.data.get("tokens") or 0)
                    after.append(str(tokens - prompt) if prompt else f"{tokens} (prompt +)")
            elif EventKind.ABORTED in kinds:
                detail = next(e.detail for e in events if e.event is EventKind.ABORTED)
                moves[request] = f"aborted ({detail})"
            else:
                moves[request] = "ended before its release"
        if not dispatched:
            return out, "not dispatched", True
        settled = all(w == "resumed" or w.startswith("refused") for w in moves.values())
        summary: dict[str, int] = {}
        for what in moves.values():
            summary[what] = summary.get(what, 0) + 1
        parts = []
        for what, n in sorted(summary.items()):
            part = f"{n}x {what}" if expected > 1 else what
            if what == "resumed" and after:
                part += f" (after {', '.join(after)} tokens)"
            parts.append(part)
        detail = ", ".join(parts)
        if len(dispatched) < expected:
            detail += f" ({len(dispatched)} of {expected} sequences seen dispatched)"
        return out, detail, settled

    async def _acted(self, request: str, decision: str, within_s: float = 60.0) -> str:
        from star.wire import EventKind

        deadline = time.monotonic() + within_s
        while time.monotonic() < deadline:
            for ev in await self.bus.request_events(request):
                if ev.migration != decision and ev.event is not EventKind.FINISHED:
                    continue
                if ev.event is EventKind.MIGRATING:
                    return "migrating"
                if ev.event is EventKind.REFUSED:
                    return f"refused: {ev.detail}"
                if ev.event is EventKind.FINISHED:
                    return "finished before the decision"
            await asyncio.sleep(0.05)
        return "no answer to the decision"

    async def _events_until_finished(self, request: str, within_s: float = 60.0) -> list[Any]:
        from star.wire import EventKind

        deadline = time.monotonic() + within_s
        while True:
            events: list[Any] = await self.bus.request_events(request)
            if any(e.event is EventKind.FINISHED for e in events) or time.monotonic() > deadline:
                return events
            await asyncio.sleep(0.1)


# -- the servers ------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def vllm_server(
    model: str,
    name: str,
    tool_parser: str,
    log: Path,
    timeout_s: float,
    reasoning_parser: str = "",
) -> Iterator[str]:
    """A plain vLLM OpenAI server on ``model`` with STAR's CPU engine arguments; yields its URL."""
    port = _free_port()
    argv = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        model,
        "--served-model-name",
        name,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--dtype",
        "float32",
        "--enforce-eager",
        "--max-model-len",
        "4096",
        "--kv-cache-memory-bytes",
        str(1 << 30),
        "--distributed-executor-backend",
        "uni",
        "--disable-uvicorn-access-log",
    ]
    if tool_parser:
        argv += ["--tool-call-parser", tool_parser, "--enable-auto-tool-choice"]
    if reasoning_parser:
        argv += ["--reasoning-parser", reasoning_parser]
    env = {
        **os.environ,
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    }
    with log.open("wb") as f:
        proc = subprocess.Popen(
            argv, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"vLLM's server exited with {proc.returncode}; log: {log}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise RuntimeError(f"vLLM's server not up after {timeout_s:.0f} s; log: {log}")
            time.sleep(1)
        yield url
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


async def collect(base: str, table: list[tuple[Case, bool]], model: str) -> list[Outcome]:
    async with httpx.AsyncClient(timeout=httpx.Timeout(300.0)) as client:
        return [await send(client, base, case, model, stream) for case, stream in table]


async def collect_migrated(
    fleet: Any, base: str, table: list[tuple[Case, bool]], model: str, bursts_s: Sequence[float]
) -> list[tuple[list[Outcome], str]]:
    """Each request sent with forced migrations; again with the next shorter burst while a
    move was overtaken by the request's end (every try's response is kept and compared)."""
    from star.bus import Bus
    from star.settings import BusSettings, RedisSettings

    bus = Bus.from_settings(RedisSettings(url=fleet.redis_url), BusSettings(), fleet.secret)
    decode = [f"decode-{i}" for i in range(fleet.decode)]
    migrator = Migrator(fleet, bus, decode)
    out: list[tuple[list[Outcome], str]] = []
    try:
        async with httpx.AsyncClient(timeout=httpx.Timeout(300.0)) as client:
            for case, stream in table:
                if case.error:
                    out.append(([await send(client, base, case, model, stream)], "-"))
                    continue
                tries: list[Outcome] = []
                for burst in bursts_s:
                    got, detail, settled = await migrator.run(
                        client, base, case, model, stream, burst
                    )
                    tries.append(got)
                    if settled:
                        break
                if len(tries) > 1:
                    detail += f" (try {len(tries)}, burst {burst * 1000:g} ms)"
                out.append((tries, detail))
    finally:
        await bus.close()
    return out


def compare(
    table: list[tuple[Case, bool]],
    vllm: list[Outcome],
    star: list[Outcome],
    tol: float,
    migrated: list[tuple[list[Outcome], str]] | None = None,
) -> list[Row]:
    rows = []
    for i, ((case, stream), a, b) in enumerate(zip(table, vllm, star, strict=True)):
        row = Row(case, stream, a, b, differences(a.doc, b.doc, tol))
        if a.status == b.status and not (a.error or b.error):
            row.diffs += shape_differences(a.fields, b.fields)
        if migrated is not None:
            tries, what = migrated[i]
            row.migrated = what
            row.migrated_diffs = [
                (f"try {k + 1}: " if len(tries) > 1 else "") + d
                for k, m in enumerate(tries)
                for d in differences(a.doc, m.doc, tol)
                + (shape_differences(a.fields, m.fields) if a.status == m.status else [])
            ]
        rows.append(row)
    return rows


def render(rows: list[Row], header: str) -> str:
    titles = ["parameter", "vLLM", "STAR", "identical"]
    show_migrated = any(r.migrated for r in rows)
    if show_migrated:
        titles += ["migrated", "identical migrated"]
    lines = [titles]
    for r in rows:
        line = [r.parameter, r.vllm.served, r.star.served, "yes" if r.identical else "NO"]
        if show_migrated:
            same = "-" if r.migrated_diffs is None else ("yes" if not r.migrated_diffs else "NO")
            line += [r.migrated or "-", same]
        lines.append(line)
    out = [header, text_table(lines, left=len(titles), rule=True)]
    diffs = [(r, r.diffs) for r in rows if r.diffs] + [
        (r, [f"(migrated) {d}" for d in r.migrated_diffs or []]) for r in rows if r.migrated_diffs
    ]
    if diffs:
        out.append("\ndifferences (vLLM vs STAR):")
        for r, ds in diffs:
            out.append(f"  {r.parameter}:")
            out += [f"    {d}" for d in ds[:6]]
            if len(ds) > 6:
                out.append(f"    ... {len(ds) - 6} more")
    identical = sum(r.identical for r in rows)
    out.append(f"\n{identical} of {len(rows)} rows identical")
    return "\n".join(out)


def markdown(rows: list[dict[str, Any]]) -> str:
    """One line per parameter (its non-streamed and streamed rows together), as a Markdown table.

    ``rows`` are :meth:`Row.as_json`'s (a saved run's ``rows.json`` too).
    """
    by: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in rows:
        by.setdefault((r["route"], r["parameter"]), []).append(r)
    migrated = any(r.get("migrated") for r in rows)
    titles = ["route", "parameter", "vLLM", "STAR", "identical"]
    if migrated:
        titles += ["migrated (not streamed; streamed)", "identical migrated"]
    lines = ["| " + " | ".join(titles) + " |", "|" + "---|" * len(titles)]

    def both(values: list[str]) -> str:
        return values[0] if len(set(values)) == 1 else "; ".join(values)

    def same(diffs: list[str] | None) -> str:
        return "-" if diffs is None else ("yes" if not diffs else "**no**")

    for (route, name), group in by.items():
        cells = [
            route,
            name if name.startswith("error") else f"`{name}`",
            both([r["vllm"] for r in group]),
            both([r["star"] for r in group]),
            both(["yes" if r["identical"] else "**no**" for r in group]),
        ]
        if migrated:
            cells.append(both([r.get("migrated") or "-" for r in group]))
            cells.append(both([same(r.get("migrated_differences")) for r in group]))
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(lines)


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--vllm-url", default="", help="a running vLLM OpenAI server (default: start one)"
    )
    parser.add_argument(
        "--star-url", default="", help="a running STAR proxy (default: start a local fleet)"
    )
    parser.add_argument("--model", default="", help="model path (default: the shipped tiny model)")
    parser.add_argument(
        "--served-model-name", default=MODEL, help=f"the model name both serve (default {MODEL})"
    )
    parser.add_argument(
        "--tool-parser", default="hermes", help="vLLM's --tool-call-parser for both ('' = none)"
    )
    parser.add_argument(
        "--reasoning-parser",
        default="",
        help="vLLM's --reasoning-parser for both (e.g. deepseek_r1; default none): adds the "
        "reasoning rows, and without --model serves the tiny model with the reasoning and "
        "tool-call markup added (star.model.markup)",
    )
    parser.add_argument("--tol", type=float, default=1e-4, help="logprob tolerance (default 1e-4)")
    parser.add_argument(
        "--only",
        action="append",
        default=[],
        help="rows whose parameter contains this (repeatable)",
    )
    parser.add_argument("--no-stream", action="store_true", help="only the non-streamed rows")
    parser.add_argument(
        "--migrate",
        action="store_true",
        help="also send every STAR request with a forced migration mid-request",
    )
    parser.add_argument(
        "--burst-ms",
        default="100,40,0",
        help="--migrate: how long the source decodes before the decision; the request is "
        "sent again with the next while a move was overtaken by its end (default 100,40,0: "
        "about 5, 2 and 0 tokens at --step-ms 20)",
    )
    parser.add_argument(
        "--step-ms",
        type=float,
        default=20.0,
        help="--migrate: the decode engines' steps padded to this many ms (emulated step "
        "time, worker.device_step_ms; timing only, never the tokens), so that a release "
        "lands within a step on any box and a burst decodes a known number of tokens "
        "(default 20; 0 = real timing, about a ms a token on the tiny model)",
    )
    parser.add_argument("--json", action="store_true", help="print the rows as JSON")
    parser.add_argument(
        "--markdown", action="store_true", help="print one Markdown line per parameter"
    )
    parser.add_argument(
        "--from-json",
        default="",
        metavar="FILE",
        help="print a saved run's rows.json as --markdown does (starts nothing)",
    )


def table_of(args: argparse.Namespace) -> list[tuple[Case, bool]]:
    rows = []
    for case in cases(tools=bool(args.tool_parser), reasoning=bool(args.reasoning_parser)):
        label = f"{case.route}: {case.name}"
        if args.only and not any(o in label for o in args.only):
            continue
        for stream in case.streams:
            if stream and args.no_stream:
                continue
            rows.append((case, stream))
    return rows


def run(args: argparse.Namespace) -> int:
    from star.model import tiny_model_path
    from star.model.markup import markup_model
    from star.settings import env_key

    if args.from_json:
        print(markdown(json.loads(Path(args.from_json).read_text())))
        return 0
    name = args.served_model_name
    table = table_of(args)
    run_dir = Path(tempfile.mkdtemp(prefix="star-conformance-"))
    model_path = args.model or str(tiny_model_path())
    if args.reasoning_parser and not args.model:
        model_path = str(markup_model(run_dir / "model", weights=True))
    if args.migrate and args.star_url:
        print("--migrate needs the fleet this command starts (not --star-url)", file=sys.stderr)
        return 2

    if args.vllm_url:
        vllm = asyncio.run(collect(args.vllm_url, table, name))
    else:
        with vllm_server(
            model_path,
            name,
            args.tool_parser,
            run_dir / "vllm.log",
            900,
            reasoning_parser=args.reasoning_parser,
        ) as url:
            print(f"vLLM's server up at {url} (log: {run_dir / 'vllm.log'})", file=sys.stderr)
            vllm = asyncio.run(collect(url, table, name))

    migrated = None
    if args.star_url:
        star = asyncio.run(collect(args.star_url, table, name))
    else:
        from star.fleet import LocalCluster

        env = {**os.environ}
        for key in ("STAR_CONFIG", "STAR_PROXY_API_KEY", "STAR_BUS_PREFIX"):
            env.pop(key, None)
        if args.tool_parser:
            env["STAR_PROXY_TOOL_CALL_PARSER"] = args.tool_parser
            env["STAR_PROXY_ENABLE_AUTO_TOOL_CHOICE"] = "true"
        if args.reasoning_parser:
            env[env_key("proxy.reasoning_parser")] = args.reasoning_parser
        if args.migrate and args.step_ms > 0:
            env[env_key("worker.device_step_ms")] = f"{args.step_ms:g}"
        with LocalCluster(
            None,
            port=0,
            prefill=1,
            decode=2,
            model=model_path if args.model or args.reasoning_parser else None,
            run_dir=run_dir / "fleet",
            env=env,
            scheduler=False,
            proxy_args=["--served-model-name", name],
        ) as fleet:
            took = fleet.wait_ready(900)
            print(f"STAR fleet ready in {took:.0f} s (logs: {fleet.run_dir})", file=sys.stderr)
            star = asyncio.run(collect(fleet.url, table, name))
            if args.migrate:
                plain = compare(table, vllm, star, args.tol)
                print(render(plain, "before the migrated pass:"), file=sys.stderr)
                migrated = asyncio.run(
                    collect_migrated(
                        fleet,
                        fleet.url,
                        table,
                        name,
                        [float(b) / 1000 for b in args.burst_ms.split(",")],
                    )
                )
    rows = compare(table, vllm, star, args.tol, migrated)
    (run_dir / "rows.json").write_text(json.dumps([r.as_json() for r in rows], indent=1))
    print(f"rows as JSON: {run_dir / 'rows.json'}", file=sys.stderr)
    if args.json:
        print(json.dumps([r.as_json() for r in rows], indent=1))
    elif args.markdown:
        print(markdown([r.as_json() for r in rows]))
    else:
        head = f"conformance: vLLM's OpenAI server vs STAR on {name} ({model_path}), logprob tolerance {args.tol:g}"
        print(render(rows, head))
    ok = all(r.identical for r in rows) and all(not r.migrated_diffs for r in rows)
    return 0 if ok else 1


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m benchmarks.conformance``."""
    return bench_main("benchmarks.conformance", configure, run, __doc__, argv)


if __name__ == "__main__":
    sys.exit(main())
