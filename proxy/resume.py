"""Resumable streams: event ids, resume tokens, and streams held across a client's reconnect.

Every event of a single-choice stream carries an SSE ``id``::

    <request id>.<tokens>.<chars>.<stage>.<tag>

``tokens`` is the completion tokens consumed, ``chars`` the characters of
text the client holds after this event, ``stage`` 0 (nothing sent yet), 1
(the role chunk and text chunks), 2 (the finish chunk) or 3 (the usage
chunk). ``tag`` binds the id to its request: 128 bits of HMAC-SHA256 under a
key derived from ``cluster.secret`` (a random key per proxy without one), so
a client cannot name another's stream and any proxy of the cluster can check
it. The position itself is not secret: a client may only move within its own
stream.

The text a stream has released is a function of its tokens (incremental
detokenisation and stop strings do not depend on how the tokens were
batched: tests/proxy/test_resume.py), so a resumed stream is a fresh
:class:`~proxy.openai.Relay` fed the same tokens from the first, skipping
the ``chars`` the client has (:meth:`~proxy.openai.Relay.resume_at`) and the
closing events it has seen.

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
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from typing import Any

import msgspec
import structlog

from proxy import sse
from proxy.adopt import FINISHED
from proxy.backend import FinishReason, GenerationRequest, TokenBatch
from proxy.http import HttpError
from proxy.openai import ParsedRequest, Relay, TextOptions
from proxy.tokenizer import ModelCard
from star.wire import Attached

log = structlog.get_logger(__name__)

START, TEXT, FINISH, USAGE = 0, 1, 2, 3
_LABEL = b"star-resume/1"
_TAG_BYTES = 16
_DONE = sse.DONE[:-2]  # "data: [DONE]"
_ID = re.compile(r"([A-Za-z0-9_-]{1,128})\.(\d{1,9})\.(\d{1,10})\.([0-3])\.([A-Za-z0-9_-]{22})")


@dataclass(frozen=True, slots=True)
class Position:
    """Where a client is in a stream (see the module docstring)."""

    tokens: int = 0
    chars: int = 0
    stage: int = START


@dataclass(frozen=True, slots=True)
class EventId:
    """A parsed event id; :meth:`Tagger.parse` checked its tag."""

    request_id: str
    position: Position


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

    def format(self, request_id: str, at: Position, tag: str | None = None) -> str:
        tag = tag or self.tag(request_id)
        return f"{request_id}.{at.tokens}.{at.chars}.{at.stage}.{tag}"

    def parse(self, text: str) -> EventId:
        """The id in ``text``; HttpError 400 if malformed, 403 if its tag is not this cluster's."""
        m = _ID.fullmatch(text.strip())
        if m is None:
            raise HttpError(
                400,
                f"'{text[:200]}' is not a stream event id (<request id>.<tokens>.<chars>.<stage>.<tag>)",
                code="invalid_stream_id",
            )
        request_id, tokens, chars, stage, tag = m.groups()
        if not hmac.compare_digest(tag, self.tag(request_id)):
            raise HttpError(
                403,
                "the stream id's tag does not match its request: resume with an id this "
                "cluster sent you",
                type="permission_error",
                code="invalid_stream_tag",
            )
        return EventId(request_id, Position(int(tokens), int(chars), int(stage)))


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
        }
    )


def request_of(
    context: bytes, prompt: list[int], models: Mapping[str, ModelCard]
) -> tuple[ParsedRequest, int]:
    """The request :func:`context_of` described, and its ``created``; HttpError if unusable."""
    try:
        ctx = msgspec.msgpack.decode(context)
        card = models.get(ctx["model"])
        known = {f.name for f in dataclasses.fields(TextOptions)}
        text = TextOptions(**{k: v for k, v in ctx["text"].items() if k in known})
        gen = GenerationRequest(
            request_id=ctx["id"],
            model=ctx["model"],
            prompt_token_ids=prompt,
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
    except (msgspec.DecodeError, KeyError, TypeError, ValueError) as exc:
        raise HttpError(
            500, f"the stream's context cannot be read: {exc}", code="stream_unreadable"
        ) from None
    if card is None:
        raise HttpError(
            404, f"the stream's model {ctx['model']!r} is not served here", code="stream_not_found"
        )
    return ParsedRequest(gen, text, card, (), echo), created


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


def check_position(request_id: str, known_from: int, since: Position) -> None:
    """HttpError 409 when a stream whose logprobs are held from token ``known_from`` on
    cannot give a client at ``since`` the logprobs it lacks."""
    if since.tokens < known_from:
        raise HttpError(
            409,
            f"stream {request_id} moved between instances after token {since.tokens} and "
            "the logprobs of the tokens before the move are no longer held: resume from an "
            f"event at or after token {known_from}",
            code="stream_logprobs_gone",
        )


class HeldStream:
    """One request's token log, written by the task that drives its backend stream.

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
        self.tokens: list[int] = []
        # their logprobs, when the request asked for them
        self.scores = None if parsed.text.logprobs is None else ScoreLog()
        self.finish_reason: FinishReason | None = None
        self.stop_reason: str | int | None = None
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
        if self.scores is not None:
            self.scores.add(batch)
        self.tokens.extend(batch.token_ids)
        if batch.finish_reason is not None:
            self.finish_reason, self.stop_reason = batch.finish_reason, batch.stop_reason
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


def not_found(request_id: str, grace_s: float) -> HttpError:
    return HttpError(
        404,
        f"no stream {request_id}: it finished more than proxy.resume_grace_s "
        f"({grace_s:g} s) ago, was cancelled, or its worker no longer holds it",
        code="stream_not_found",
    )


class Reader:
    """One client's view of a stream, sans-IO: its events after ``since``, each with its id.

    ``relay`` is fresh: it is fed the stream's tokens from the first, and
    sends from ``since`` on (the role chunk and ``since.chars`` of text
    skipped, and the closing events the client has).
    """

    def __init__(self, relay: Relay, since: Position, tagger: Tagger, ids: bool = True) -> None:
        self.relay = relay
        self.since = since
        # Without ``ids`` the events go out as plain ``data:`` lines (a client
        # that did not ask for SSE: vLLM's bench client reads nothing else).
        self.ids = ids
        if since.stage >= TEXT:
            relay.resume_at(since.chars, since.tokens)
        self._id = tagger.format(relay.req.request_id, Position(), "").rsplit(".", 4)[0]
        self._tag = tagger.tag(relay.req.request_id)
        self._chat = relay.req.kind == "chat"

    def feed(self, batch: TokenBatch) -> bytes:
        """The events of ``batch`` (its tokens follow those fed before)."""
        started = self.relay.started
        return self._with_ids(self.relay.feed(batch), started)

    def end(self) -> bytes:
        """The closing events (usage, ``[DONE]``) once the choice has finished."""
        started = self.relay.started
        return self._with_ids(self.relay.end(), started, closing=True)

    def event_id(self, at: Position) -> bytes:
        return f"{self._id}.{at.tokens}.{at.chars}.{at.stage}.{self._tag}".encode()

    def _with_ids(self, out: bytes, started: bool, closing: bool = False) -> bytes:
        if not out or not self.ids:
            return out
        relay, choice = self.relay, self.relay.choices[0]
        kept = []
        for k, part in enumerate(out.split(b"\n\n")[:-1]):
            if part == _DONE:
                kept.append(part)
                continue
            if self._chat and not started and k == 0:
                at = Position(0, 0, TEXT)  # the role chunk
            elif closing:
                at = Position(choice.num_tokens, relay.released[0], USAGE)
            else:
                stage = FINISH if choice.finish_reason is not None else TEXT
                at = Position(choice.num_tokens, relay.released[0], stage)
            if self.since.stage >= FINISH and at.stage <= self.since.stage:
                continue  # the client has it
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
    count_first: bool = True,
) -> AsyncIterator[bytes]:
    """The first client's SSE body: drives ``source`` (its ``first`` batch read), logging it.

    ``on_batch`` sees every batch (the metrics), the first unless ``count_first``
    is false (a stream taken over: its first batch is what another proxy relayed).

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
            if batch is not first or count_first:
                on_batch(batch)
            stream.record(batch)
            out = reader.feed(batch)
            if out:
                yield out
            if relay.cut:
                break  # a stop string matched: closing the stream aborts upstream
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
        cursor = 0
        while not relay.done:
            changed = stream.changed()
            tokens = stream.tokens
            if cursor < len(tokens) or stream.finish_reason is not None:
                batch = TokenBatch(tokens[cursor:], stream.finish_reason, stream.stop_reason)
                if stream.scores is not None:
                    batch = dataclasses.replace(batch, **stream.scores.fields(cursor, len(tokens)))
                cursor = len(tokens)
                out = reader.feed(batch)
                if out:
                    yield out
                if relay.cut:
                    break  # the driver cuts at the same token
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
