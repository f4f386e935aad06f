"""Resumable streams: event ids, resume tokens, and streams held across a client's reconnect.

Every event of a stream carries an SSE ``id``::

    <request id>.<tokens>.<chars>.<stage>.<tag>

``tokens`` is the completion tokens consumed, ``chars`` the characters of
text the client holds after this event, ``stage`` 0 (nothing sent yet), 1
(the role chunk and text chunks), 2 (the finish chunk) or 3 (the usage
chunk). A stream of several choices (``n > 1``, batched prompts: one
upstream request each, :mod:`proxy.fanout`) gives each of the three fields
per choice, joined by ``-`` (``cmpl-x.4-7.17-30.1-2.<tag>``: choice 1 has
finished). ``tag`` binds the id to its request: 128 bits of HMAC-SHA256 under a
key derived from ``cluster.secret`` (a random key per proxy without one), so
a client cannot name another's stream and any proxy of the cluster can check
it. The position itself is not secret: a client may only move within its own
stream.

The text a stream has released is a function of its tokens (incremental
detokenisation and stop strings do not depend on how the tokens were
batched: tests/proxy/test_resume.py), so a resumed stream is a fresh
:class:`~proxy.openai.Relay` fed the same tokens from the first, skipping
the ``chars`` the client has (:meth:`~proxy.openai.Relay.resume_at`) and the
closing events it has seen. A chat with vLLM's reasoning or tool-call parser
resumes at ``tokens`` instead: its parser reads one token at a time (so what
it has read and sent is a function of the tokens, not of their batching), and
a fresh one reads them all again, sending the deltas of those after the
client's. A chat echo's chunk counts as its choice's first characters.

:class:`HeldStream` is one request's token log; :class:`Streams` keeps
them by request id. The first client's body drives the backend stream
(:func:`drive`, one task per token as without resume); a client that goes
away is detached by the HTTP server instead of cancelled, and the body drives
on, its bytes dropped. With no reader left a stream still decoding is held
``proxy.resume_grace_s`` seconds (0: the request is aborted at once, as
before), then aborted upstream (its KV freed); a finished one is kept as
long for a client that missed the end. Resumed clients read the log
(:func:`follow`).
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import hashlib
import hmac
import re
import secrets
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec
import structlog

from proxy import sse
from proxy.adopt import FINISHED
from proxy.backend import FinishReason, GenerationRequest, TokenBatch
from proxy.chat_tools import ChatCall
from proxy.fanout import drop_if_cut
from proxy.http import HttpError
from proxy.openai import MAX_CHOICES, ParsedRequest, Relay, TextOptions
from proxy.tokenizer import ModelCard
from star.wire import Attached, PromptLogprobs

log = structlog.get_logger(__name__)

START, TEXT, FINISH, USAGE = 0, 1, 2, 3
_LABEL = b"star-resume/1"
_TAG_BYTES = 16
_DONE = sse.DONE[:-2]  # "data: [DONE]"
_MAX = MAX_CHOICES - 1
_ID = re.compile(
    rf"([A-Za-z0-9_-]{{1,128}})\.(\d{{1,9}}(?:-\d{{1,9}}){{0,{_MAX}}})"
    rf"\.(\d{{1,10}}(?:-\d{{1,10}}){{0,{_MAX}}})\.([0-3](?:-[0-3]){{0,{_MAX}}})"
    r"\.([A-Za-z0-9_-]{22})"
)


@dataclass(frozen=True, slots=True)
class Position:
    """Where a client is in a stream (see the module docstring)."""

    tokens: int = 0
    chars: int = 0
    stage: int = START


Positions = tuple[Position, ...]  # one per choice


@dataclass(frozen=True, slots=True)
class EventId:
    """A parsed event id; :meth:`Tagger.parse` checked its tag."""

    request_id: str
    positions: Positions

    @property
    def position(self) -> Position:
        """The first choice's (a single-choice stream's only one)."""
        return self.positions[0]


class Tagger:
    """Formats event ids and checks their tags (the key: ``cluster.secret``'s, or random)."""

    def __init__(self, secret: str = "") -> None:
        if secret:
            self._key = hmac.new(secret.encode(), _LABEL, hashlib.sha256).digest()
        else:  # resume on this proxy only
            self._key = secrets.token_bytes(32)
        self.shared = bool(secret)

    def tag(self, request_id: str) -> str:
        mac = hmac.new(self._key, request_id.encode(), hashlib.sha256).digest()[:_TAG_BYTES]
        return base64.urlsafe_b64encode(mac).rstrip(b"=").decode()

    def format(
        self, request_id: str, at: Position | Sequence[Position], tag: str | None = None
    ) -> str:
        tag = tag or self.tag(request_id)
        ats = (at,) if isinstance(at, Position) else at
        tokens = "-".join(str(p.tokens) for p in ats)
        chars = "-".join(str(p.chars) for p in ats)
        stages = "-".join(str(p.stage) for p in ats)
        return f"{request_id}.{tokens}.{chars}.{stages}.{tag}"

    def parse(self, text: str) -> EventId:
        """The id in ``text``; HttpError 400 if malformed, 403 if its tag is not this cluster's."""
        m = _ID.fullmatch(text.strip())
        if m is None:
            raise HttpError(
                400,
                f"'{text[:200]}' is not a stream event id (<request id>.<tokens>.<chars>.<stage>.<tag>)",
                code="invalid_stream_id",
            )
        request_id, tokens, chars, stages, tag = m.groups()
        fields = [f.split("-") for f in (tokens, chars, stages)]
        if len({len(f) for f in fields}) != 1:
            raise HttpError(
                400,
                f"'{text[:200]}' gives the choices' tokens, characters and stages in different "
                "numbers",
                code="invalid_stream_id",
            )
        if not hmac.compare_digest(tag, self.tag(request_id)):
            raise HttpError(
                403,
                "the stream id's tag does not match its request: resume with an id this "
                "cluster sent you",
                type="permission_error",
                code="invalid_stream_tag",
            )
        positions = tuple(Position(int(t), int(c), int(s)) for t, c, s in zip(*fields, strict=True))
        return EventId(request_id, positions)


def context_of(parsed: ParsedRequest, created: int) -> bytes:
    """What another proxy needs to rebuild the response of ``parsed`` (its prompt aside)."""
    gen = parsed.gen
    return msgspec.msgpack.encode(
        {
            "v": 1,
            "id": gen.request_id,
            "model": gen.model,
            "kind": gen.kind,
            "created": created,
            "sampling": dict(gen.sampling),
            "stop": list(gen.stop),
            "include_usage": gen.include_usage,
            "migratable": gen.migratable,
            "text": {f.name: getattr(parsed.text, f.name) for f in dataclasses.fields(parsed.text)},
            "echo": list(parsed.echo),
            "prompts": len(parsed.batch),
            # A batch's prompts, for a choice that never reached a worker (prompts_of).
            "batch": _batch_of(parsed),
            "role": parsed.role,
            "chat_echo": parsed.chat_echo,
            "asked_max_tokens": parsed.asked_max_tokens,
            "prompt_text": parsed.prompt_text,
            # A chat's parser input (its prompt is the worker's): another proxy's
            # parsers read the tokens from the first (Relay.resume_at).
            "chat": None
            if parsed.chat is None
            else {
                "request": dict(parsed.chat.request),
                "template_kwargs": dict(parsed.chat.template_kwargs),
            },
        }
    )


BATCH_CONTEXT_TOKENS = 1 << 20  # a batch's prompts in every choice's context: this many, at most


def _batch_of(parsed: ParsedRequest) -> list[list[int]] | None:
    """The prompts of a batched completion, for its context, if they fit the bound.

    Every choice's context carries them (``prompts x n`` copies), so a choice
    whose proxy died before it reached a decode worker can be started again
    by another proxy even when no choice of its prompt was found
    (:func:`prompts_of`). Past :data:`BATCH_CONTEXT_TOKENS` in all the copies
    together they are left out (such a choice's stream is then not found).
    """
    batch = parsed.batch
    if len(batch) < 2 or parsed.num_choices * sum(map(len, batch)) > BATCH_CONTEXT_TOKENS:
        return None
    return [list(p) for p in batch]


def prompts_of(request_id: str, context: bytes, known: Mapping[int, list[int]]) -> list[list[int]]:
    """Every prompt of the request :func:`context_of` described: ``known`` (by prompt
    index, from the workers that hold its choices), the rest from the context;
    HttpError 404 when a prompt is in neither."""
    prompts, _ = fan_of(context)
    if len(known) == prompts:
        return [known[p] for p in range(prompts)]
    batch = msgspec.msgpack.decode(context).get("batch") or []
    if len(batch) != prompts:
        why = "no worker holds a choice of one of its prompts, and its context lacks them"
        raise not_found(request_id, 0, why)
    return [known.get(p, batch[p]) for p in range(prompts)]


def check_unstarted(request_id: str, since: Position, choice: int) -> None:
    """HttpError 404 unless the client at ``since`` has none of ``choice``'s tokens:
    no worker holds that choice, so only one that has sent nothing can run again."""
    if since.tokens > 0:
        why = "its worker no longer holds it (worker.orphan_grace_s)"
        raise not_found(f"{request_id} (choice {choice})", 0, why)


def fan_of(context: bytes) -> tuple[int, int]:
    """The prompts and ``n`` of the request :func:`context_of` described (its choices:
    their product, one upstream request each); HttpError if unusable."""
    try:
        ctx = msgspec.msgpack.decode(context)
        return int(ctx.get("prompts", 1)), int(ctx["sampling"].get("n", 1))
    except (msgspec.DecodeError, KeyError, TypeError, ValueError, AttributeError) as exc:
        raise HttpError(
            500, f"the stream's context cannot be read: {exc}", code="stream_unreadable"
        ) from None


def request_of(
    context: bytes, prompts: Sequence[list[int]], models: Mapping[str, ModelCard]
) -> tuple[ParsedRequest, int]:
    """The request :func:`context_of` described (``prompts``: its prompts, from the
    workers that hold its choices), and its ``created``; HttpError if unusable."""
    try:
        ctx = msgspec.msgpack.decode(context)
        card = models.get(ctx["model"])
        known = {f.name for f in dataclasses.fields(TextOptions)}
        text = TextOptions(**{k: v for k, v in ctx["text"].items() if k in known})
        gen = GenerationRequest(
            request_id=ctx["id"],
            model=ctx["model"],
            prompt_token_ids=prompts[0],
            sampling=ctx["sampling"],
            kind=ctx["kind"],
            stop=tuple(ctx["stop"]),
            stream=True,
            include_usage=bool(ctx["include_usage"]),
            migratable=bool(ctx["migratable"]),
            arrival_s=time.monotonic(),
            context=context,
        )
        created = int(ctx["created"])
        echo = tuple(ctx["echo"])
        role = str(ctx.get("role", "assistant"))
        chat_echo = ctx.get("chat_echo")
        asked = int(ctx.get("asked_max_tokens", 0))
        prompt_text = ctx.get("prompt_text")
        chat = None
        if ctx.get("chat") is not None:
            chat = ChatCall(
                request=ctx["chat"]["request"],
                prompt_token_ids=tuple(prompts[0]),
                template_kwargs=ctx["chat"]["template_kwargs"],
            )
    except (msgspec.DecodeError, KeyError, TypeError, ValueError) as exc:
        raise HttpError(
            500, f"the stream's context cannot be read: {exc}", code="stream_unreadable"
        ) from None
    if card is None:
        raise HttpError(
            404, f"the stream's model {ctx['model']!r} is not served here", code="stream_not_found"
        )
    batch = tuple(prompts) if len(prompts) > 1 else ()
    parsed = ParsedRequest(
        gen, text, card, batch, echo, chat=chat, role=role, chat_echo=chat_echo,
        asked_max_tokens=asked, prompt_text=prompt_text,
    )  # fmt: skip
    return parsed, created


class ScoreLog:
    """The logprobs of a held stream's tokens: parallel arrays, as a LogprobTokens frame has them.

    A stream taken over from a worker that got its request by a migration
    has the logprobs of that worker's tokens alone (:class:`~star.wire.Attached`):
    the tokens before ``known_from`` hold placeholders (:func:`adopted_batch`),
    which no reader sends: a resume from before ``known_from`` is refused
    (:func:`check_position`), and :meth:`~proxy.openai.Relay.resume_at` skips
    the logprobs of the tokens a client has.
    """

    __slots__ = ("known_from", "logprobs", "top_ids", "top_logprobs")

    def __init__(self, known_from: int = 0) -> None:
        self.known_from = known_from
        self.logprobs: list[float] = []
        self.top_ids: list[int] = []
        self.top_logprobs: list[float] = []

    def add(self, batch: TokenBatch) -> None:
        if not batch.token_ids:
            return
        if batch.logprobs is None:
            raise ValueError("backend sent tokens without the logprobs the request asked for")
        self.logprobs.extend(batch.logprobs)
        self.top_ids.extend(batch.top_ids or ())
        self.top_logprobs.extend(batch.top_logprobs or ())

    def fields(self, start: int, end: int) -> dict[str, Any]:
        """TokenBatch's logprobs fields for the stream's tokens ``start:end``."""
        k = len(self.top_ids) // len(self.logprobs) if self.logprobs else 0
        return {
            "logprobs": self.logprobs[start:end],
            "top_ids": self.top_ids[start * k : end * k],
            "top_logprobs": self.top_logprobs[start * k : end * k],
        }


def adopted_batch(done: Attached, top: int | None) -> tuple[TokenBatch, int]:
    """The first batch of a stream taken over from a worker (``done``: its answer), and the
    index of its first token with logprobs (all of them without ``top``: none asked for).

    ``top``: the top entries per token the request asked for, the rank of the
    placeholders given to the tokens whose logprobs the worker does not hold.
    """
    finish = done.finish_reason if done.finish_reason in FINISHED else None
    batch = TokenBatch(list(done.output_token_ids), finish, done.stop_reason)  # type: ignore[arg-type]
    if top is None:
        return batch, 0
    outputs = len(done.output_token_ids)
    held = done.logprobs
    if held is None or len(held) != outputs - done.scored_from:  # a worker that keeps none
        known, held, top_ids, top_lps = outputs, [], [], []
    else:
        known, top_ids, top_lps = done.scored_from, done.top_ids, done.top_logprobs
        if held:
            top = done.top_k
    batch.logprobs = [0.0] * known + list(held)
    batch.top_ids = [0] * (known * top) + list(top_ids)
    batch.top_logprobs = [0.0] * (known * top) + list(top_lps)
    return batch, known


def check_position(request_id: str, known_from: int, since: Position, choice: int = 0) -> None:
    """HttpError 409 when a stream whose logprobs are held from token ``known_from`` on
    (of its ``choice``) cannot give a client at ``since`` the logprobs it lacks."""
    if since.tokens < known_from:
        raise HttpError(
            409,
            f"{_stream(request_id, choice)} moved between instances after token {since.tokens} and "
            "the logprobs of the tokens before the move are no longer held: resume from an "
            f"event at or after token {known_from}",
            code="stream_logprobs_gone",
        )


def prompt_stand_in(
    request_id: str, prompt: list[int], since: Position, choice: int
) -> PromptLogprobs:
    """Prompt logprobs standing in for an echoed prompt's in a stream taken over from a
    worker whose context lacks them (the decode instance prefilled the request itself,
    and sent them to the proxy that ran it alone): a client that has the choice's first
    chunk has the real ones, which a resumed relay skips (of the prompt only its tokens
    count there, for the text offsets). HttpError 409 for a client that lacks them."""
    if since.stage < TEXT:
        raise HttpError(
            409,
            f"{_stream(request_id, choice)} echoes its prompt with logprobs, which only the proxy "
            "that ran it held (its decode instance prefilled it): resume from an event after "
            "the first chunk",
            code="stream_logprobs_gone",
        )
    n = max(len(prompt) - 1, 0)
    return PromptLogprobs(stream=0, logprobs=[0.0] * n, ranks=[1] * n)


def check_choices(request_id: str, given: int, has: int) -> None:
    """HttpError 400 when a stream id gives ``given`` choices' positions for a stream of ``has``."""
    if given != has:
        raise HttpError(
            400,
            f"the stream id gives {given} choices' positions, stream {request_id} has "
            f"{has} choices",
            code="invalid_stream_id",
        )


def _stream(request_id: str, choice: int) -> str:
    """How an error names a stream (and the choice, past the first)."""
    return f"stream {request_id}" + (f" (choice {choice})" if choice else "")


def check_positions(stream: HeldStream, since: Positions) -> None:
    """HttpError 400 when ``since`` does not give each of ``stream``'s choices a position,
    409 when the logprobs a choice's client lacks are gone (:func:`check_position`)."""
    check_choices(stream.request_id, len(since), len(stream.choices))
    for i, (log, at) in enumerate(zip(stream.choices, since, strict=True)):
        if log.scores is not None:
            check_position(stream.request_id, log.scores.known_from, at, i)


class ChoiceLog:
    """One choice's tokens as the driver recorded them, and their logprobs when asked for."""

    __slots__ = ("finish_reason", "prompt", "scores", "stop_reason", "tokens")

    def __init__(self, scored: bool) -> None:
        self.tokens: list[int] = []
        self.scores = ScoreLog() if scored else None
        self.prompt: PromptLogprobs | None = None  # its first batch's (echo with logprobs)
        self.finish_reason: FinishReason | None = None
        self.stop_reason: str | int | None = None

    def since(self, cursor: int) -> TokenBatch:
        """A batch of the tokens from ``cursor`` on (and the finish, once known)."""
        batch = TokenBatch(self.tokens[cursor:], self.finish_reason, self.stop_reason)
        if cursor == 0:
            batch.prompt = self.prompt
        if self.scores is not None:
            batch = dataclasses.replace(batch, **self.scores.fields(cursor, len(self.tokens)))
        return batch


class HeldStream:
    """One request's token log (a :class:`ChoiceLog` per choice), written by the task
    that drives its backend stream.

    The driver is the first client's response body (:func:`drive`): the
    per-token path stays one task, as without resume. When that client goes
    away the server detaches it instead of cancelling (:meth:`detach`) and
    the body drives on, writing nowhere, until the stream ends or
    :meth:`stop` cancels it. Resumed readers (:func:`follow`) read the log.
    """

    def __init__(self, parsed: ParsedRequest, created: int, streams: Streams) -> None:
        self.parsed = parsed
        self.request_id = parsed.gen.request_id
        self.created = created  # every reader's chunks say the same
        scored = parsed.text.logprobs is not None
        self.choices = [ChoiceLog(scored) for _ in range(parsed.num_choices)]
        self.error: BaseException | None = None
        self.ended = False  # no token will come any more
        self.stopping = False  # aborted upstream (or being)
        self.readers = 1  # the driver's client, then resumed ones
        self.driver: asyncio.Task[Any] | None = None
        self.timer: asyncio.TimerHandle | None = None
        self._streams = streams
        self._changed: asyncio.Event | None = None  # made only while a reader waits
        self._driver_attached = True

    def record(self, batch: TokenBatch) -> None:
        """The driver's batch: tokens and finish together (a reader never sees one alone)."""
        if not 0 <= batch.index < len(self.choices):
            raise ValueError(f"backend sent choice index {batch.index} for n={len(self.choices)}")
        log = self.choices[batch.index]
        if batch.prompt is not None:
            log.prompt = batch.prompt
        if log.scores is not None:
            log.scores.add(batch)
        log.tokens.extend(batch.token_ids)
        if batch.finish_reason is not None:
            log.finish_reason, log.stop_reason = batch.finish_reason, batch.stop_reason
        self._notify()

    def end(self, error: BaseException | None = None) -> None:
        self.ended = True
        if error is not None:
            self.error = error
        self._notify()

    def _notify(self) -> None:
        changed = self._changed
        if changed is not None:
            self._changed = None
            changed.set()

    def changed(self) -> asyncio.Event:
        """Set at the next change (take it before checking the state, then wait)."""
        if self._changed is None:
            self._changed = asyncio.Event()
        return self._changed

    def attach(self) -> None:
        self.readers += 1
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None

    def detach(self) -> None:
        """The driver's client went away (the server's hook), or a resumed reader did."""
        self.readers -= 1
        if self.readers == 0:
            self._streams.idle(self)

    def detach_driver(self) -> None:
        if self._driver_attached:
            self._driver_attached = False
            self.detach()

    def stop(self) -> None:
        """Abort upstream (the grace ran out, a DELETE, shutdown): cancel the driver."""
        self.stopping = True
        task = self.driver
        if task is not None and not task.done() and task is not asyncio.current_task():
            task.cancel("stream stopped")


ErrorEvent = Callable[[Relay, BaseException], bytes]
OnEnd = Callable[[str, BaseException | None], None]


class Streams:
    """The held streams of one proxy, by request id."""

    def __init__(self, tagger: Tagger, grace_s: float) -> None:
        self.tagger = tagger
        self.grace_s = grace_s
        self.live: dict[str, HeldStream] = {}

    def hold(self, parsed: ParsedRequest, created: int) -> HeldStream:
        stream = HeldStream(parsed, created, self)
        self.live[stream.request_id] = stream
        return stream

    def idle(self, stream: HeldStream) -> None:
        """No reader left: hold the stream for the grace period, then let it go."""
        if self.grace_s <= 0:
            self.forget(stream)
            return
        if not stream.ended and not stream.stopping:
            log.info("stream_held", request_id=stream.request_id, grace_s=self.grace_s)
        loop = asyncio.get_running_loop()
        stream.timer = loop.call_later(self.grace_s, self._expired, stream)

    def _expired(self, stream: HeldStream) -> None:
        stream.timer = None
        if stream.readers == 0:
            if not stream.ended and not stream.stopping:
                log.info("held_stream_aborted", request_id=stream.request_id)
            self.forget(stream)

    def forget(self, stream: HeldStream) -> None:
        """Drop ``stream`` (aborting it upstream if it still runs)."""
        if self.live.get(stream.request_id) is stream:
            del self.live[stream.request_id]
        if stream.timer is not None:
            stream.timer.cancel()
            stream.timer = None
        if not stream.ended:
            stream.stop()

    def parse(self, path_id: str, last_event_id: str | None) -> EventId:
        """The event a resume names (``Last-Event-ID`` wins over the path)."""
        event = self.tagger.parse(last_event_id or path_id)
        if last_event_id and path_id.split(".", 1)[0] != event.request_id:
            raise HttpError(
                400,
                "Last-Event-ID names another request than the path",
                code="invalid_stream_id",
            )
        return event

    def find(self, path_id: str, last_event_id: str | None) -> tuple[HeldStream, Position]:
        """The stream and position a resume names, held here (HttpError 404 if not)."""
        event = self.parse(path_id, last_event_id)
        stream = self.live.get(event.request_id)
        if stream is None:
            raise not_found(event.request_id, self.grace_s)
        return stream, event.position

    def close(self) -> None:
        """Abort every held stream (the proxy is shutting down)."""
        for stream in list(self.live.values()):
            self.forget(stream)


def not_found(request_id: str, grace_s: float, why: str = "") -> HttpError:
    """404 for a stream no proxy or worker holds (``grace_s``: this proxy's resume grace)."""
    why = why or (
        f"it finished more than proxy.resume_grace_s ({grace_s:g} s) ago, was cancelled, "
        "or its worker no longer holds it"
    )
    return HttpError(404, f"no stream {request_id}: {why}", code="stream_not_found")


class Reader:
    """One client's view of a stream, sans-IO: its events after ``since``, each with its id.

    ``relay`` is fresh: it is fed the stream's tokens from the first, and
    sends from ``since`` on (each choice's role chunk and ``chars`` of text
    skipped, and the closing events the client has). ``since``: one
    position per choice (one position: every choice's).
    """

    def __init__(
        self, relay: Relay, since: Position | Sequence[Position], tagger: Tagger, ids: bool = True
    ) -> None:
        self.relay = relay
        count = len(relay.choices)
        self.since = (since,) * count if isinstance(since, Position) else tuple(since)
        if len(self.since) != count:
            raise ValueError(f"{len(self.since)} positions for {count} choices")
        # Without ``ids`` the events go out as plain ``data:`` lines (a client
        # that did not ask for SSE: vLLM's bench client reads nothing else).
        self.ids = ids
        if any(p.stage >= TEXT for p in self.since):
            relay.resume_at(
                [p.chars for p in self.since],
                [p.tokens for p in self.since],
                [p.stage >= TEXT for p in self.since],
            )
        self._at = list(self.since)  # each choice's position after the last event out
        self._rid = relay.req.request_id
        self._tag = tagger.tag(self._rid)
        self._tagger = tagger

    def feed(self, batch: TokenBatch) -> bytes:
        """The events of ``batch`` (its tokens follow those of its choice fed before)."""
        opening, echoing = self.relay.unopened(), self.relay.unechoed()
        return self._with_ids(self.relay.feed(batch), opening + echoing, batch.index, opening)

    def end(self) -> bytes:
        """The closing events (usage, ``[DONE]``) once every choice has finished."""
        opening, echoing = self.relay.unopened(), self.relay.unechoed()
        return self._with_ids(self.relay.end(), opening + echoing, None, opening)

    def event_id(self, at: Position | Sequence[Position]) -> bytes:
        return self._tagger.format(self._rid, at, self._tag).encode()

    def _with_ids(
        self, out: bytes, opening: list[int], index: int | None, roles: list[int]
    ) -> bytes:
        """``out``'s events with ids. A relay's output is the opening chunks of the
        choices in ``opening`` (a chat's first output: the role chunks of those in
        ``roles``, then the echo chunks of the rest), then one chunk of choice
        ``index``, or the usage chunk (``index`` None: the end), then ``[DONE]``."""
        if not out or not self.ids:
            return out
        relay, at, since = self.relay, self._at, self.since
        kept = []
        for k, part in enumerate(out.split(b"\n\n")[:-1]):
            if part == _DONE:
                kept.append(part)
                continue
            if k < len(roles):  # a role chunk
                at[opening[k]] = Position(0, 0, TEXT)
            elif k < len(opening):  # a chat echo's chunk: the choice's first characters
                at[opening[k]] = Position(0, relay.echo_chars, TEXT)
            elif index is None:  # the usage chunk
                if all(p.stage >= USAGE for p in since):
                    continue  # the client has it
                at[:] = [
                    Position(c.num_tokens, relay.released[i], USAGE)
                    for i, c in enumerate(relay.choices)
                ]
            else:
                choice = relay.choices[index]
                stage = FINISH if choice.finish_reason is not None else TEXT
                if since[index].stage >= FINISH and stage <= since[index].stage:
                    continue  # the client has it
                at[index] = Position(choice.num_tokens, relay.released[index], stage)
            kept.append(b"id: " + self.event_id(at) + b"\n" + part)
        return b"".join(p + b"\n\n" for p in kept)


async def drive(
    stream: HeldStream,
    reader: Reader,
    source: AsyncIterator[TokenBatch],
    first: TokenBatch,
    on_batch: Callable[[TokenBatch], None],
    error_event: ErrorEvent,
    on_end: OnEnd,
    uncounted: int = 0,
) -> AsyncIterator[bytes]:
    """The first client's SSE body: drives ``source`` (its ``first`` batch read), logging it.

    ``on_batch`` sees every batch (the metrics) but the first ``uncounted``
    (a stream taken over: its first batches are what another proxy relayed).
    A choice of several cut by a stop string has its request aborted, the
    others go on (:func:`proxy.fanout.drop_if_cut`).

    Closing or cancelling the body closes ``source`` (the request is aborted
    upstream unless it finished); a client that goes away detaches it
    (:meth:`HeldStream.detach_driver`) and it drives on.
    """
    stream.driver = asyncio.current_task()
    relay = reader.relay
    outcome, error = "cancelled", None
    try:
        yield b""
        batch: TokenBatch | None = first
        while batch is not None:
            if uncounted > 0:
                uncounted -= 1
            else:
                on_batch(batch)
            stream.record(batch)
            out = reader.feed(batch)
            if out:
                yield out
            if relay.cut:
                break  # a stop string matched: closing the stream aborts upstream
            await drop_if_cut(relay, source, batch)
            batch = await anext(source, None)
        outcome = "finished"
        yield reader.end()
    except Exception as exc:  # headers are out: the error goes in-band
        outcome, error = "failed", exc
        stream.error = exc
        yield error_event(relay, exc)
    finally:
        try:
            aclose = getattr(source, "aclose", None)
            if aclose is not None:
                await aclose()
        finally:
            stream.end()
            stream.detach_driver()
            on_end(outcome, error)


async def follow(
    stream: HeldStream, reader: Reader, error_event: ErrorEvent, on_end: OnEnd
) -> AsyncIterator[bytes]:
    """A resumed client's SSE body: the stream's log from the first token, then what comes.

    The first (empty) yield attaches the reader; closing the body detaches it.
    """
    stream.attach()
    relay = reader.relay
    outcome, error = "cancelled", None
    try:
        yield b""
        cursors = [0] * len(stream.choices)
        while not relay.done:
            changed = stream.changed()
            new = [
                i
                for i, log in enumerate(stream.choices)
                if not relay.choices[i].finish_reason
                and (cursors[i] < len(log.tokens) or log.finish_reason is not None)
            ]
            for i in new:
                log = stream.choices[i]
                batch = dataclasses.replace(log.since(cursors[i]), index=i)
                cursors[i] = len(log.tokens)
                out = reader.feed(batch)
                if out:
                    yield out
            if relay.cut:
                break  # the driver cuts at the same tokens
            if new:
                continue
            if stream.ended:
                if stream.error is not None:
                    raise stream.error
                raise RuntimeError("the stream was aborted before it finished")
            await changed.wait()
        while not relay.cut and not stream.ended:  # [DONE] after the backend's stream ended
            await stream.changed().wait()
        out = reader.end()
        outcome = "finished"
        yield out
    except Exception as exc:
        outcome, error = "failed", exc
        yield error_event(relay, exc)
    finally:
        stream.detach()
        on_end(outcome, error)
