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

:class:`HeldStream` owns one request's backend stream in a task of its own
(a client that goes away cancels its reader, never the request) and logs its
tokens; :class:`Streams` keeps them by request id. When its last reader is
gone a stream still decoding is held ``proxy.resume_grace_s`` seconds (0:
aborted at once), then aborted upstream; a finished one is kept as long for
a client that missed the end.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import hmac
import re
import secrets
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import structlog

from proxy import sse
from proxy.backend import FinishReason, TokenBatch
from proxy.http import HttpError
from proxy.openai import ParsedRequest, Relay

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


class HeldStream:
    """One request's backend stream, pumped by its own task into a token log."""

    def __init__(
        self,
        parsed: ParsedRequest,
        source: AsyncIterator[TokenBatch],
        on_batch: Callable[[TokenBatch], None],
        on_idle: Callable[[HeldStream], None],
        created: int,
    ) -> None:
        self.parsed = parsed
        self.request_id = parsed.gen.request_id
        self.created = created  # every reader's chunks say the same
        self.tokens: list[int] = []
        self.finish_reason: FinishReason | None = None
        self.stop_reason: str | int | None = None
        self.error: BaseException | None = None
        self.ended = False  # no token will come any more
        self.stopping = False  # aborted upstream (or being)
        self.readers = 0
        self.changed = asyncio.Event()  # set (and replaced) on every change
        self.timer: asyncio.TimerHandle | None = None
        self._on_batch = on_batch
        self._on_idle = on_idle
        self.task = asyncio.create_task(self._pump(source), name=f"held:{self.request_id}")

    async def _pump(self, source: AsyncIterator[TokenBatch]) -> None:
        try:
            async for batch in source:
                self._on_batch(batch)
                # Tokens and the finish together: a reader never sees one without the other.
                self.tokens.extend(batch.token_ids)
                if batch.finish_reason is not None:
                    self.finish_reason, self.stop_reason = batch.finish_reason, batch.stop_reason
                self._notify()
        except Exception as exc:  # the readers report it (as the relay did before)
            self.error = exc
        finally:
            self.ended = True
            self._notify()
            aclose = getattr(source, "aclose", None)
            if aclose is not None:
                await aclose()

    def _notify(self) -> None:
        self.changed.set()
        self.changed = asyncio.Event()

    async def first(self) -> None:
        """Wait for the first tokens, or the end of the stream."""
        while not self.tokens and self.finish_reason is None and not self.ended:
            await self.changed.wait()

    def attach(self) -> None:
        self.readers += 1
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None

    def detach(self) -> None:
        self.readers -= 1
        if self.readers == 0:
            self._on_idle(self)

    def stop(self) -> None:
        """Abort upstream (a stop string matched, the grace ran out, a DELETE)."""
        self.stopping = True
        if not self.task.done():
            self.task.cancel("stream stopped")

    async def stopped(self) -> None:
        """Stop and wait until the backend stream is closed."""
        self.stop()
        with contextlib.suppress(asyncio.CancelledError):
            await self.task


ErrorEvent = Callable[[Relay, BaseException], bytes]


class Streams:
    """The held streams of one proxy, by request id."""

    def __init__(self, tagger: Tagger, grace_s: float) -> None:
        self.tagger = tagger
        self.grace_s = grace_s
        self.live: dict[str, HeldStream] = {}

    def hold(
        self,
        parsed: ParsedRequest,
        source: AsyncIterator[TokenBatch],
        on_batch: Callable[[TokenBatch], None],
        created: int,
    ) -> HeldStream:
        stream = HeldStream(parsed, source, on_batch, self._idle, created)
        self.live[stream.request_id] = stream
        stream.task.add_done_callback(self._pumped)
        return stream

    def _pumped(self, task: asyncio.Task[None]) -> None:
        if not task.cancelled() and (exc := task.exception()) is not None:
            log.error("held_stream_failed", error=repr(exc))

    def _idle(self, stream: HeldStream) -> None:
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
        stream.stop()

    def find(self, path_id: str, last_event_id: str | None) -> tuple[HeldStream, Position]:
        """The stream and position a resume names (``Last-Event-ID`` wins over the path)."""
        given = last_event_id if last_event_id else path_id
        event = self.tagger.parse(given)
        if last_event_id and path_id.split(".", 1)[0] != event.request_id:
            raise HttpError(
                400,
                "Last-Event-ID names another request than the path",
                code="invalid_stream_id",
            )
        stream = self.live.get(event.request_id)
        if stream is None:
            raise HttpError(
                404,
                f"no stream {event.request_id} here: it finished more than "
                f"proxy.resume_grace_s ({self.grace_s:g} s) ago, was cancelled, or never ran "
                "on this proxy",
                code="stream_not_found",
            )
        return stream, event.position

    async def close(self) -> None:
        """Abort every held stream (the proxy is shutting down)."""
        streams = list(self.live.values())
        for stream in streams:
            self.forget(stream)
        for stream in streams:
            await stream.stopped()


class Reader:
    """One client's view of a stream, sans-IO: its events after ``since``, each with its id.

    ``relay`` is fresh: it is fed the stream's tokens from the first, and
    sends from ``since`` on (the role chunk and ``since.chars`` of text
    skipped, and the closing events the client has).
    """

    def __init__(self, relay: Relay, since: Position, tagger: Tagger) -> None:
        self.relay = relay
        self.since = since
        if since.stage >= TEXT:
            relay.resume_at(since.chars)
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
        if not out:
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


async def events(
    stream: HeldStream,
    reader: Reader,
    error_event: ErrorEvent,
    on_end: Callable[[str, BaseException | None], None],
) -> AsyncIterator[bytes]:
    """The SSE body of one reader of ``stream``.

    The first (empty) yield attaches the reader; closing the body detaches
    it (:meth:`Streams._idle` decides what becomes of the stream then).
    """
    stream.attach()
    relay = reader.relay
    outcome, error = "cancelled", None
    try:
        yield b""
        cursor = 0
        while not relay.done:
            changed = stream.changed
            tokens = stream.tokens
            if cursor < len(tokens) or stream.finish_reason is not None:
                batch = TokenBatch(tokens[cursor:], stream.finish_reason, stream.stop_reason)
                cursor = len(tokens)
                out = reader.feed(batch)
                if out:
                    yield out
                if relay.cut:
                    stream.stop()  # a stop string matched: abort upstream
                    break
                continue
            if stream.ended:
                if stream.error is not None:
                    raise stream.error
                raise RuntimeError("backend stream ended before every choice finished")
            await changed.wait()
        while not relay.cut and not stream.ended:  # the backend's stream ends after its finish
            await stream.changed.wait()
        out = reader.end()
        outcome = "finished"
        yield out
    except asyncio.CancelledError:
        raise
    except Exception as exc:
        outcome, error = "failed", exc
        yield error_event(relay, exc)
    finally:
        stream.detach()
        on_end(outcome, error)
