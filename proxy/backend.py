"""The contract between the proxy's HTTP/OpenAI front and whatever produces tokens.

The front end (``proxy.app``) turns an OpenAI request into a
:class:`GenerationRequest`, calls :meth:`Backend.generate` and relays the
:class:`TokenBatch` es it yields. Everything upstream of that call (prefill,
decode dispatch, migration re-routing, the framed-msgpack worker protocol) is
the backend's business; everything downstream (detokenisation, stop strings,
SSE framing, usage) is the front end's.

Cancellation contract: the front end stops consuming a stream in two ways,
and in both the backend must abort the request upstream and free its KV:

* the consuming task is cancelled (the client went away, or shutdown):
  ``CancelledError`` is raised at the generator's current ``await``;
* the front end closes the iterator early (a stop string matched, or the
  client asked for fewer tokens than were produced): ``aclose()`` raises
  ``GeneratorExit`` at the current ``yield``.

An ``async def generate(...)`` generator with a ``try/finally`` that sends the
abort covers both.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Any, Literal, Protocol, runtime_checkable

from star.sampling import migration_blocker
from star.wire import Error, ErrorCode, PromptLogprobs

FinishReason = Literal["stop", "length", "abort"]
RequestKind = Literal["completion", "chat"]


@dataclass(frozen=True, slots=True)
class GenerationRequest:
    """One request as the backend sees it: token ids in, sampling as vLLM kwargs.

    ``sampling`` holds keyword arguments for ``vllm.SamplingParams``
    (``max_tokens``, ``temperature``, ``top_p``, ``top_k``, ``min_p``, ``seed``,
    penalties, ``stop_token_ids``, ``ignore_eos``, ``min_tokens``, ``n``,
    ``logit_bias``, ``allowed_token_ids``, ``structured_outputs`` as a plain
    dict of ``StructuredOutputsParams`` kwargs). It never contains ``stop``:
    stop *strings* are matched by the proxy on detokenised text (``stop``
    below), so the engine must not detokenise or match them itself; the
    backend stops the request when the proxy closes the iterator.
    ``max_tokens`` (and ``min_tokens``) count from the first generated token:
    a backend that continues a request elsewhere reduces them by the tokens
    already delivered.
    """

    request_id: str
    model: str
    prompt_token_ids: list[int]
    sampling: Mapping[str, Any]
    kind: RequestKind = "completion"
    stop: tuple[str, ...] = ()
    stream: bool = False
    include_usage: bool = False
    migratable: bool = True
    arrival_s: float = 0.0  # time.monotonic() when the HTTP request was complete
    # The proxy's description of the response, for a resume on any proxy
    # (proxy.resume.context_of); empty: the request is not resumable there.
    context: bytes = b""

    @property
    def max_tokens(self) -> int:
        """The token budget of each choice (``sampling["max_tokens"]``)."""
        return int(self.sampling["max_tokens"])

    @property
    def n(self) -> int:
        """Choices asked for; the front end fans ``n > 1`` out (:mod:`proxy.fanout`), so a
        backend is sent ``n = 1`` requests only."""
        return int(self.sampling.get("n", 1))


@dataclass(slots=True)
class TokenBatch:
    """New tokens of one choice, in order, each token delivered exactly once.

    ``finish_reason`` is set on the last batch of a choice (it may carry
    tokens too): ``"stop"`` (EOS or a stop token id, then ``stop_reason`` is
    that id or None), ``"length"`` (``max_tokens`` reached) or ``"abort"``
    (the engine gave up on the request). ``index`` selects the choice when
    several are merged into one stream (:class:`proxy.fanout.FanIn` sets it).
    A request with logprobs gets ``logprobs`` (one per token) and, flat, ``k``
    top ``(id, logprob)`` pairs per token in ``top_ids`` / ``top_logprobs``
    (:class:`star.wire.LogprobTokens`); None: none asked for. A request with
    prompt logprobs gets them on its first batch (``prompt``).
    """

    token_ids: list[int]
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None
    index: int = 0
    logprobs: list[float] | None = None
    top_ids: list[int] | None = None
    top_logprobs: list[float] | None = None
    prompt: PromptLogprobs | None = None


class BackendError(Exception):
    """A request failed in the backend; ``status`` is the HTTP status to answer with.

    Raised before the first batch, it becomes that HTTP error; raised
    mid-stream, it becomes an SSE error event (the status line is gone).
    ``message`` is for the log and may name instances, addresses and
    exception text: the client sees it only for a 4xx, and then ``public``
    instead where given; a 5xx gets a fixed text and the request id.
    """

    status: int = 502
    error_type: str = "upstream_error"

    def __init__(self, message: str, *, code: str | None = None, public: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.code = code
        self.public = public


class BackendUnavailable(BackendError):
    """No instance can take the request right now (none up, all draining)."""

    status = 503
    error_type = "service_unavailable"


class BackendOverloaded(BackendError):
    """The fleet refuses more work for now; the client should retry later."""

    status = 429
    error_type = "rate_limit_exceeded"


class RequestRejected(BackendError):
    """The engine refused this particular request (e.g. it does not fit the context)."""

    status = 400
    error_type = "BadRequestError"  # vLLM's type for an engine's refusal


_UNAVAILABLE = frozenset({ErrorCode.SHUTTING_DOWN, ErrorCode.ENGINE_DEAD})


def error_from(msg: Error, instance: str) -> BackendError:
    """The client-facing error for a worker's :class:`~star.wire.Error` frame on ``instance``."""
    text = f"{instance}: {msg.message}"
    # The engine's word on the request (the client sees it without where it ran).
    if msg.code == ErrorCode.BAD_REQUEST:
        return RequestRejected(text, code=msg.code, public=msg.message)
    if msg.code in _UNAVAILABLE:
        return BackendUnavailable(text, code=msg.code)
    return BackendError(text, code=msg.code)


@runtime_checkable
class Backend(Protocol):
    """Produces tokens for requests; see the module docstring for cancellation."""

    def generate(self, req: GenerationRequest) -> AsyncIterator[TokenBatch]:
        """Stream the request's new tokens; usually an ``async def`` generator.

        Raise :class:`BackendError` for failures the client should see. Each
        choice ends with one batch whose ``finish_reason`` is set; the iterator
        ends after every choice has finished.
        """
        ...

    def health(self) -> dict[str, Any]:
        """A JSON-able snapshot for ``GET /health``; ``{"ok": False, ...}`` makes it 503."""
        ...


def is_migratable(sampling: Mapping[str, Any]) -> bool:
    """Whether a request's sampling state survives a move (:func:`star.sampling.migration_blocker`)."""
    return migration_blocker(sampling) is None
