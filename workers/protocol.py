"""The worker side of the internal token protocol, without IO (docs/design.md §4.3, §5).

The proxy talks to a worker over one TCP connection carrying length-prefixed
msgpack frames (:mod:`star.wire`), multiplexed by ``stream``:

* worker -> proxy, once per connection: :class:`~star.wire.Hello`;
* proxy -> worker: :class:`~star.wire.Generate` opens a stream,
  :class:`~star.wire.Abort` ends it (the client went away) and frees its KV,
  :class:`~star.wire.Release` asks for a D->D handoff (docs/design.md §5.1);
* worker -> proxy: :class:`~star.wire.Tokens` carry the *new* token ids of a
  stream; the last one has ``finish_reason`` set (``"abort"`` acknowledges an
  Abort) and, on a prefill worker, the ``kv_transfer_params`` a decode worker
  needs to pull the KV through NIXL; :class:`~star.wire.Error` ends a stream
  that failed, except a refusal (:data:`~star.wire.REFUSAL_CODES`: a Generate
  on a stream id still open, a Release the worker cannot do) which leaves the
  open stream alone -- :func:`~star.wire.ends_stream` tells them apart;
  ``stream`` = :data:`~star.wire.CONNECTION_STREAM` marks a connection-level
  problem (an undecodable frame); :class:`~star.wire.Handoff` answers a Release.

This module holds what the TCP adapter (:mod:`workers.server`) and the vLLM
adapter (:mod:`workers.engine`) share: the engine interface the server drives,
the request and delta values that cross it, the exceptions behind the error
codes (:class:`star.wire.ErrorCode`, which the proxy matches too), and the
per-stream state machine as a table (:mod:`star.transitions`).
"""

from __future__ import annotations

import enum
from collections.abc import AsyncGenerator, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol

from star.transitions import IllegalTransition as IllegalTransition
from star.transitions import stepper
from star.wire import Error, ErrorCode, Generate, LogprobTokens, PromptLogprobs, Tokens

# -- errors -------------------------------------------------------------------


class WorkerError(Exception):
    """A stream failed in a way the proxy is told about (as an Error frame)."""

    code: ClassVar[ErrorCode] = ErrorCode.INTERNAL


class BadRequest(WorkerError):
    """The request cannot run as given (bad sampling, prompt too long, ...)."""

    code = ErrorCode.BAD_REQUEST


class DuplicateRequest(WorkerError):
    """A request with this id is already running on this worker."""

    code = ErrorCode.DUPLICATE_REQUEST


class Unsupported(WorkerError):
    """The engine does not implement this operation (a test fake's Release, say)."""

    code = ErrorCode.UNSUPPORTED


class ReleaseRefused(WorkerError):
    """A Release the worker cannot do now; the stream goes on."""

    code = ErrorCode.NOT_RELEASABLE


class EngineFailed(WorkerError):
    """The engine failed this request; others may still run."""

    code = ErrorCode.ENGINE_ERROR


class EngineDead(WorkerError):
    """The engine died; every stream on this worker fails."""

    code = ErrorCode.ENGINE_DEAD


class ShuttingDown(WorkerError):
    """The worker is draining and refuses new streams."""

    code = ErrorCode.SHUTTING_DOWN


def error_frame(stream: int, exc: WorkerError) -> Error:
    """The Error frame that reports ``exc`` on ``stream``."""
    return Error(stream=stream, code=exc.code.value, message=str(exc) or type(exc).__name__)


# -- values crossing the engine interface ----------------------------------------------


@dataclass(frozen=True, slots=True)
class GenerateRequest:
    """One request for the engine: token ids in, sampling as vLLM keyword arguments."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: Mapping[str, Any]
    kv_transfer_params: Mapping[str, Any] | None = None
    continued: int = 0  # tokens generated before this leg (they end the prompt)
    fusion: list[float] | None = None  # the source's predictor state (workers.tap.FUSION_KEY)
    resume: bool = False  # a true continuation: the continued tokens are outputs, sampling original

    @classmethod
    def from_frame(cls, msg: Generate) -> GenerateRequest:
        """The request a Generate frame asks for."""
        return cls(
            request_id=msg.request_id,
            prompt_token_ids=msg.prompt_token_ids,
            sampling=msg.sampling,
            kv_transfer_params=msg.kv_transfer_params,
            continued=msg.continued,
            fusion=msg.fusion,
            resume=msg.resume is True,
        )


@dataclass(frozen=True, slots=True)
class PromptScores:
    """A prompt's logprobs as :class:`star.wire.PromptLogprobs` carries them (see there)."""

    logprobs: list[float]
    ranks: list[int]
    top_ids: list[int]
    top_logprobs: list[float]

    def to_frame(self, stream: int) -> PromptLogprobs:
        return PromptLogprobs(
            stream=stream,
            logprobs=self.logprobs,
            ranks=self.ranks,
            top_ids=self.top_ids,
            top_logprobs=self.top_logprobs,
        )


@dataclass(frozen=True, slots=True)
class TokenDelta:
    """Tokens new since the previous delta of a request; the last one has ``finish_reason``."""

    token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    kv_transfer_params: dict[str, Any] | None = None
    num_prompt_tokens: int = 0
    # A request with logprobs: each token's logprob, and k top (id, logprob)
    # per token, flat (star.wire.LogprobTokens). None: none asked for.
    logprobs: list[float] | None = None
    top_ids: list[int] = field(default_factory=list)
    top_logprobs: list[float] = field(default_factory=list)
    # The prompt's logprobs, on the first delta of a request that asked for
    # them and computed its prompt here (sent as a PromptLogprobs frame first).
    prompt: PromptScores | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def to_frame(self, stream: int) -> Tokens:
        """This delta as the Tokens frame of ``stream`` (LogprobTokens when it has logprobs)."""
        if self.logprobs is not None and self.token_ids:
            return LogprobTokens(
                stream=stream,
                token_ids=self.token_ids,
                finish_reason=self.finish_reason,
                stop_reason=self.stop_reason,
                kv_transfer_params=self.kv_transfer_params,
                num_prompt_tokens=self.num_prompt_tokens,
                logprobs=self.logprobs,
                top_ids=self.top_ids,
                top_logprobs=self.top_logprobs,
            )
        return Tokens(
            stream=stream,
            token_ids=self.token_ids,
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
            kv_transfer_params=self.kv_transfer_params,
            num_prompt_tokens=self.num_prompt_tokens,
        )


def delta_logprobs(logprobs: Any, count: int, k: int | None = None) -> dict[str, Any]:
    """A delta's logprobs as :class:`TokenDelta` fields ({} when the request asked for none).

    ``logprobs`` is vLLM's ``CompletionOutput.logprobs`` for the delta's
    ``count`` tokens, as :class:`vllm.logprobs.FlatLogprobs`
    (``flat_logprobs``, which :func:`workers.engine_config.sampling_params` sets):
    per position the sampled token first, then the top k in rank order.
    ``k``: the top count the request asked for. vLLM merges the deltas of
    steps a slow reader has not taken yet (``RequestOutput.add``) with
    ``FlatLogprobs.extend``, which rebuilds each position as a map: a
    sampled token that is also among the top k then appears once, and
    that position holds k - 1 top entries. Given ``k``, it is put back in
    the top list at its rank, so every position carries k.
    """
    if logprobs is None:
        return {}
    starts, ends = list(logprobs.start_indices), list(logprobs.end_indices)
    if len(starts) != count:
        raise EngineFailed(f"the engine gave logprobs for {len(starts)} of {count} tokens")
    values, ids, ranks = logprobs.logprobs, logprobs.token_ids, logprobs.ranks
    sampled: list[float] = []
    top_ids: list[int] = []
    top_logprobs: list[float] = []
    for start, end in zip(starts, ends, strict=True):
        sampled.append(float(values[start]))
        pos_ids = [int(t) for t in ids[start + 1 : end]]
        pos_values = [float(v) for v in values[start + 1 : end]]
        if k is not None and len(pos_ids) == k - 1 and int(ids[start]) not in pos_ids:
            at = int(ranks[start]) - 1  # merged away: the sampled token was ranked <= k
            if 0 <= at <= len(pos_ids):
                pos_ids.insert(at, int(ids[start]))
                pos_values.insert(at, float(values[start]))
        top_ids.extend(pos_ids)
        top_logprobs.extend(pos_values)
    return {"logprobs": sampled, "top_ids": top_ids, "top_logprobs": top_logprobs}


def prompt_scores(prompt_logprobs: Any, prompt_tokens: int) -> PromptScores | None:
    """A request's prompt logprobs as a :class:`PromptScores` (None: none asked for or given).

    ``prompt_logprobs`` is vLLM's ``RequestOutput.prompt_logprobs`` as
    :class:`vllm.logprobs.FlatLogprobs` (``flat_logprobs``): position 0 empty
    (the first prompt token has none), then per position the prompt token
    with its rank, then the top k in rank order, as the engine's
    ``LogprobsProcessor`` appends them. Raises :class:`EngineFailed` when it
    does not cover the prompt.
    """
    if prompt_logprobs is None or len(prompt_logprobs) == 0:
        return None
    starts, ends = list(prompt_logprobs.start_indices), list(prompt_logprobs.end_indices)
    if len(starts) != prompt_tokens or (starts and starts[0] != ends[0]):
        raise EngineFailed(
            f"the engine gave prompt logprobs for {len(starts)} positions of {prompt_tokens}"
        )
    values, ids, ranks = prompt_logprobs.logprobs, prompt_logprobs.token_ids, prompt_logprobs.ranks
    out = PromptScores([], [], [], [])
    for start, end in zip(starts[1:], ends[1:], strict=True):
        if end <= start:
            raise EngineFailed("the engine gave an empty prompt logprobs position")
        out.logprobs.append(float(values[start]))
        out.ranks.append(int(ranks[start]))
        out.top_ids.extend(int(t) for t in ids[start + 1 : end])
        out.top_logprobs.extend(float(v) for v in values[start + 1 : end])
    return out


@dataclass(frozen=True, slots=True)
class HandoffInfo:
    """Where a released request's KV is held (the body of a Handoff frame)."""

    kv_transfer_params: dict[str, Any]
    num_tokens: int
    fusion: list[float] | None = None  # the length predictor's state (workers.tap.FUSION_KEY)


class Engine(Protocol):
    """What the token server needs from an engine (:class:`workers.engine.EngineHandle`).

    ``generate`` is an async generator: it raises :class:`WorkerError` for a
    request the proxy should hear about, and aborts the request in the engine
    (freeing its KV) when it is cancelled or closed early.
    """

    def generate(self, request: GenerateRequest) -> AsyncGenerator[TokenDelta, None]:
        """Run ``request``; yield its token deltas, the last with ``finish_reason``."""
        ...

    async def release(self, request_id: str, migration: str) -> HandoffInfo:
        """Stop ``request_id`` at a step boundary with its KV held (D->D, docs/design.md §5)."""
        ...


# -- the life of one stream, as a table (h11 style) -------------------------------------


class StreamState(enum.StrEnum):
    """Where one stream of a connection is."""

    RUNNING = "running"  # tokens flow
    ABORTING = "aborting"  # Abort (or disconnect) seen; the engine request is being aborted
    RELEASING = "releasing"  # Release seen; waiting for the engine to hold the KV
    CLOSED = "closed"  # final frame sent (or the connection is gone)


class StreamEvent(enum.StrEnum):
    """What can happen to a stream."""

    ABORT = "abort"  # Abort frame, or the connection closed
    RELEASE = "release"  # Release frame
    HANDOFF = "handoff"  # the engine holds the KV; Handoff frame sent
    REFUSE = "refuse"  # the release failed or is unsupported; Error sent, tokens go on
    FINISH = "finish"  # final Tokens or Error frame sent / task ended


TRANSITIONS: dict[tuple[StreamState, StreamEvent], StreamState] = {
    (StreamState.RUNNING, StreamEvent.ABORT): StreamState.ABORTING,
    (StreamState.RUNNING, StreamEvent.RELEASE): StreamState.RELEASING,
    (StreamState.RUNNING, StreamEvent.FINISH): StreamState.CLOSED,
    (StreamState.ABORTING, StreamEvent.ABORT): StreamState.ABORTING,
    (StreamState.ABORTING, StreamEvent.FINISH): StreamState.CLOSED,
    # A release that fails (or is unsupported) leaves the stream running.
    (StreamState.RELEASING, StreamEvent.REFUSE): StreamState.RUNNING,
    (StreamState.RELEASING, StreamEvent.FINISH): StreamState.CLOSED,
    (StreamState.RELEASING, StreamEvent.HANDOFF): StreamState.CLOSED,
    (StreamState.RELEASING, StreamEvent.ABORT): StreamState.ABORTING,
    (StreamState.RELEASING, StreamEvent.RELEASE): StreamState.RELEASING,
}


next_state = stepper("stream", TRANSITIONS)
"""The state after an event; one that cannot happen raises IllegalTransition (a worker bug)."""
