"""Every message STAR puts on a wire, defined once (docs/design.md §4).

Two families share one encoding, a msgpack map ``{"k": kind, ...fields, "v":
SCHEMA_VERSION}``:

* bus messages, the body of Redis stream entries: :class:`Report`,
  :class:`Decision`, :class:`Event`, and :class:`LoadEntry` (the values of the
  ``<prefix>:load`` hash);
* frames of the internal token protocol between proxy and workers (framed
  msgpack over TCP, multiplexed by ``stream``): :class:`Hello`,
  :class:`Generate`, :class:`Tokens` (:class:`LogprobTokens` with logprobs),
  :class:`PromptLogprobs`,
  :class:`Abort`, :class:`Release`,
  :class:`Handoff`, :class:`Error`, the heartbeats :class:`Ping` and
  :class:`Pong` (:mod:`star.liveness`), and the authentication handshake
  before Hello (:mod:`star.handshake`): :class:`Challenge`, :class:`Answer`,
  :class:`Accept`.

Each message is a frozen ``msgspec.Struct``, one tagged union over the kinds
(vLLM's ``vllm/v1/engine/__init__.py`` does the same): msgspec encodes and
decodes them, checks every type and bound, and names the field at fault.
Decoding is strict: a wrong version, an unknown kind, a missing field, an
unknown field or a value of the wrong type raises a :class:`WireError`
subclass, never a half-built message. Encoding and decoding happen only at
the boundary (the bus adapter, the protocol reader); the rest of the code
passes these Structs around.
"""

from __future__ import annotations

import enum
import re
import struct
import time
from collections.abc import Callable, Iterator
from typing import Annotated, Any, ClassVar, TypeVar, Union

import msgspec

SCHEMA_VERSION = 1
MAX_FRAME_BYTES = 64 * 1024 * 1024


# -- errors -------------------------------------------------------------------


class WireError(ValueError):
    """A message could not be decoded; ``str()`` says why."""


class BadEncoding(WireError):
    """Not msgpack, or not a map."""


class UnknownVersion(WireError):
    """The schema version ``v`` is not one this build reads."""


class UnknownKind(WireError):
    """The kind ``k`` is not a known message (or not the one expected)."""


class MissingField(WireError):
    """A required field is absent."""


class UnknownField(WireError):
    """A field this version does not define is present."""


class WrongType(WireError):
    """A field holds a value of the wrong type."""


class FrameTooLarge(WireError):
    """A protocol frame announces more than ``MAX_FRAME_BYTES``."""


# -- base ---------------------------------------------------------------------

# Counted, never negative: tokens, requests, steps, sequence numbers. (Measured
# floats get no bounds: a rounding error must not get a report refused.)
Count = Annotated[int, msgspec.Meta(ge=0)]


class _Schema(msgspec.Struct, frozen=True, forbid_unknown_fields=True, gc=False):
    """Frozen, and strict when decoded. ``gc=False``: a message holds no cycles,
    so the collector need not track the tens of thousands a scheduler keeps
    (its reports' RequestLoads)."""


class _Version(enum.IntEnum):
    """``v`` of a message built here: equal to SCHEMA_VERSION and encoded as it,
    but not the plain ``int`` the decoder reads, so :func:`decode` can tell a
    map that carried no ``v`` (the field's default) from one that did."""

    CURRENT = SCHEMA_VERSION

    def __repr__(self) -> str:
        return repr(self.value)


class Message(_Schema, frozen=True, tag_field="k", kw_only=True):
    """Base of every top-level message; ``KIND`` is its tag, the map's ``k``."""

    KIND: ClassVar[str] = ""
    v: int = _Version.CURRENT  # keyword-only, so each kind's fields keep their positions

    def summary(self) -> dict[str, str]:
        """Plain-text fields stored next to the body in a stream entry."""
        return {"kind": self.KIND}


class EventKind(enum.StrEnum):
    """Lifecycle events on ``<prefix>:events``."""

    DISPATCHED = "dispatched"  # proxy: request placed on a decode instance
    FINISHED = "finished"  # proxy: request done (ok, aborted by client, error)
    MIGRATING = "migrating"  # proxy: decision accepted, Release sent to the source
    RELEASED = "released"  # source worker: stopped at a step boundary, KV held
    KV_PULLED = "kv_pulled"  # target worker: blocks pulled through NIXL
    RESUMED = "resumed"  # proxy: first token from the target reached the client
    ABORTED = "aborted"  # migration failed; detail says which side
    REFUSED = "refused"  # decision rejected (unknown / finished / not migratable)
    EXPIRED = "expired"  # scheduler: no outcome before the decision timeout
    WORKER_UP = "worker_up"
    WORKER_DOWN = "worker_down"
    INSTANCE_STALE = "instance_stale"  # scheduler: reports stopped
    LEADER = "leader"  # scheduler: this process became leader


# -- bus messages ---------------------------------------------------------------


class RequestLoad(_Schema, frozen=True):
    """One running request inside a :class:`Report`."""

    id: str
    tokens: Count  # N(r): prompt + generated tokens in the KV cache
    generated: Count
    predicted_remaining: float | None = None  # R-hat(r); None before the first prediction
    migratable: bool = True
    # Tokens it has left to generate when its length is fixed (ignore_eos with
    # max_tokens, no stop condition: workers.state.length_budget); None: not known.
    true_remaining: Count | None = None


class Report(Message, frozen=True, tag="report"):
    """A worker's periodic state report (``<prefix>:reports``)."""

    instance: str
    role: str
    seq: Count
    ts: float
    address: str  # host:port of its internal token protocol
    capacity_tokens: Count
    used_tokens: Count
    bytes_per_token: Count
    step_time_s: float  # mean decode step time since the last report
    delta: Count  # decode steps between trace points
    trace: list[float]  # L(tau_0..tau_H), the worker's pre-simulated load
    requests: list[RequestLoad]
    in_flight: list[str] = []
    waiting: Count = 0
    preemptions: Count = 0
    # Its worker is stopping: it takes no new streams (nor migrated requests),
    # its running ones may still be moved away until ``worker_down``.
    draining: bool = False
    # Whether a length predictor is loaded (decode workers): without one its
    # requests have no R-hat and predicted / bins modes see them as endless.
    # None: not said (a prefill worker, or a worker older than this field).
    predictor: bool | None = None
    # Emulated device timing (worker.device_step_ms): the share of the step
    # time since the last report that was padding; 0 on real timing.
    pad_share: float = 0.0
    # Token-protocol peers that failed the handshake (cluster.secret) since
    # the worker started: anything above 0 is a misconfigured proxy or a probe.
    refused_peers: Count = 0
    # Which run of the worker process this is (its start, wall-clock
    # microseconds); ``seq`` counts from 1 in each. Readers take reports in
    # that order (star.report_gate). UNSET (not said) is not written: such a
    # report keeps the bytes it had before the field (an older reader refuses
    # one that says it: upgrade proxies and schedulers before workers).
    incarnation: Count | msgspec.UnsetType = msgspec.UNSET

    def summary(self) -> dict[str, str]:
        return {"kind": self.KIND, "instance": self.instance, "load": str(self.used_tokens)}


class Decision(Message, frozen=True, tag="decision"):
    """Migrate ``request`` from ``source`` to ``target`` (``<prefix>:decisions``)."""

    id: str
    request: str
    source: str
    target: str
    tick: Count
    delta_v: float
    mode: str
    ts: float
    fence: Count = 0  # leader's fencing token; 0 for manual decisions
    origin: str = "scheduler"  # or "manual" (star migrate)
    reason: str = "balance"  # Algorithm 1's; "drain": the source is draining (star.planner.drain)

    def summary(self) -> dict[str, str]:
        return {
            "kind": self.KIND,
            "request": self.request,
            "source": self.source,
            "target": self.target,
        }


class Event(Message, frozen=True, tag="event"):
    """A lifecycle event (``<prefix>:events``)."""

    event: EventKind
    ts: float
    origin: str  # who says it: an instance id, "proxy:<id>" or "scheduler:<id>"
    request: str = ""
    migration: str = ""
    instance: str = ""
    detail: str = ""
    data: dict[str, Any] = {}

    @classmethod
    def now(cls, event: EventKind, origin: str, **fields: Any) -> Event:
        """``event`` said by ``origin`` now (wall-clock ``ts``)."""
        return cls(event, time.time(), origin, **fields)

    def summary(self) -> dict[str, str]:
        out = {"kind": self.event.value, "origin": self.origin}
        if self.request:
            out["request"] = self.request
        if self.instance:
            out["instance"] = self.instance
        return out


class LoadEntry(Message, frozen=True, tag="load"):
    """One decode instance in the dispatch view (``<prefix>:load`` hash)."""

    instance: str
    role: str
    address: str
    tokens: Count
    capacity_tokens: Count
    workload: float
    running: Count
    ts: float


# -- internal token protocol frames ----------------------------------------------


class Challenge(Message, frozen=True, tag="challenge"):
    """First frame of a worker that has a cluster secret: a fresh random nonce."""

    nonce: bytes


class Answer(Message, frozen=True, tag="answer"):
    """The proxy's reply to :class:`Challenge`: its proof, and its own nonce for the worker."""

    proof: bytes
    nonce: bytes


class Accept(Message, frozen=True, tag="accept"):
    """The worker's proof of the secret over the proxy's nonce; Hello follows."""

    proof: bytes


class Hello(Message, frozen=True, tag="hello"):
    """First frame a worker sends on a new connection."""

    instance: str
    role: str
    model: str


class Generate(Message, frozen=True, tag="generate"):
    """Start (or continue, after a handoff) a request on a worker.

    ``continued``: on a continuation, how many tokens the request had already
    generated; they end ``prompt_token_ids`` (0 for a fresh request).
    ``fusion``: on a continuation, the length predictor's state the source
    handed over (:class:`Handoff`), or None.
    ``resume``: True on a continuation sent as one (docs/design.md §5.2): the
    ``continued`` tokens ending the prompt are the request's outputs so far
    and ``sampling`` is the request's own, budgets not reduced. UNSET (not
    written, so a frame without it keeps its bytes): ``sampling`` is already
    the continuation's (:func:`star.sampling.continuation`).
    """

    stream: int
    request_id: str
    prompt_token_ids: list[int]
    sampling: dict[str, Any]  # vLLM SamplingParams keyword arguments
    kv_transfer_params: dict[str, Any] | None = None
    continued: Count = 0
    fusion: list[float] | None = None
    resume: bool | msgspec.UnsetType = msgspec.UNSET


class Tokens(Message, frozen=True, tag="tokens"):
    """New output tokens of a stream; ``finish_reason`` set on the last frame."""

    stream: int
    token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    kv_transfer_params: dict[str, Any] | None = None
    num_prompt_tokens: Count = 0


class LogprobTokens(Tokens, frozen=True, tag="logprob_tokens"):
    """:class:`Tokens` of a request that asked for logprobs (``sampling["logprobs"]``: k).

    A kind of its own, so that plain Tokens frames keep their bytes and a peer
    from before it never sees one (such a proxy refuses logprobs). Parallel
    arrays, never a map per token: ``logprobs[i]`` is the log-probability of
    ``token_ids[i]`` (vLLM's raw logprobs; ``-inf`` kept), and ``top_ids`` /
    ``top_logprobs`` hold, flat, the k most likely tokens at each position in
    rank order (``k = len(top_ids) // len(token_ids)``; k = 0: both empty).
    The sampled token may be among them.
    """

    logprobs: list[float] = []
    top_ids: list[int] = []
    top_logprobs: list[float] = []

    @property
    def top_k(self) -> int:
        """How many top tokens each position carries."""
        return len(self.top_ids) // len(self.token_ids) if self.token_ids else 0

    def consistent(self) -> bool:
        """Whether the arrays fit ``token_ids`` (one logprob per token, k top per token)."""
        n, k = len(self.token_ids), self.top_k
        return len(self.logprobs) == n and len(self.top_ids) == len(self.top_logprobs) == n * k


class PromptLogprobs(Message, frozen=True, tag="prompt_logprobs"):
    """The prompt's logprobs of a request that asked for them (``sampling["prompt_logprobs"]``: k).

    Sent once, before the stream's first :class:`Tokens`, by the worker that
    computed the prompt (the prefill worker, or a decode worker prefilling it
    itself); a continuation never computes them again. Position ``i`` is
    prompt token ``i + 1`` (the first token has none, as in vLLM):
    ``logprobs[i]`` its log-probability (vLLM's raw logprobs; ``-inf``
    kept), ``ranks[i]`` its rank in the vocabulary, and ``top_ids`` /
    ``top_logprobs`` hold, flat, the k most likely tokens there in rank order
    (``k = len(top_ids) // len(logprobs)``). A kind of its own: only a proxy
    that asks for prompt logprobs gets one.
    """

    stream: int
    logprobs: list[float]
    ranks: list[int]
    top_ids: list[int] = []
    top_logprobs: list[float] = []

    @property
    def top_k(self) -> int:
        """How many top tokens each position carries."""
        return len(self.top_ids) // len(self.logprobs) if self.logprobs else 0

    def consistent(self, prompt_tokens: int) -> bool:
        """Whether the arrays fit a prompt of ``prompt_tokens`` (one entry per token after the
        first, k top per entry)."""
        n, k = len(self.logprobs), self.top_k
        return (
            n == max(prompt_tokens - 1, 0)
            and len(self.ranks) == n
            and len(self.top_ids) == len(self.top_logprobs) == n * k
        )


class ResumableGenerate(Generate, frozen=True, tag="generate_resumable"):
    """:class:`Generate` of a request a client may resume on any proxy (``proxy.resume``).

    ``context``: the proxy's opaque description of the response (its kind,
    ids, text options, the original sampling), handed back by
    :class:`Attached`; every leg of the request carries it, so whichever
    worker holds the request has it. A kind of its own: Generate keeps its bytes.
    """

    context: bytes = b""


class Attach(Message, frozen=True, tag="attach"):
    """Take over ``request_id``'s stream as ``stream`` on this connection.

    The worker answers :class:`Attached`, then the request's new tokens on
    ``stream``; or an Error (``unknown_request``). A request another live
    connection runs is moved: that connection gets ``Error(moved)``.
    """

    stream: int
    request_id: str


class Attached(Message, frozen=True, tag="attached"):
    """Answer to :class:`Attach`: what a proxy needs to serve the request from here.

    ``prompt_token_ids``: the request's prompt (without the tokens a
    continuation carried); ``output_token_ids``: every token it has generated
    so far, on this worker and before; ``finish_reason`` set if it has ended
    (no frame follows); ``released``: its KV was handed off for a migration
    that never completed (no token follows: continue it elsewhere).

    A request with logprobs also carries those of the tokens generated here,
    as :class:`LogprobTokens` does: ``output_token_ids[scored_from:]``'s,
    parallel arrays (``logprobs``: None, the request asked for none). The
    tokens before ``scored_from`` came with a continuation; their logprobs
    were computed on the instance it moved from. ``prompt``: the prompt's
    logprobs, when this worker computed them (it prefilled the request
    itself); UNSET (not written, so a frame without them keeps its bytes)
    otherwise.
    """

    stream: int
    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    context: bytes
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    released: bool = False
    logprobs: list[float] | None = None
    top_ids: list[int] = []
    top_logprobs: list[float] = []
    scored_from: int = 0
    prompt: PromptLogprobs | msgspec.UnsetType = msgspec.UNSET

    @property
    def top_k(self) -> int:
        """How many top tokens each scored position carries (as :class:`LogprobTokens`)."""
        return len(self.top_ids) // len(self.logprobs) if self.logprobs else 0


class Abort(Message, frozen=True, tag="abort"):
    """The client went away: stop the stream and free its KV."""

    stream: int


class Release(Message, frozen=True, tag="release"):
    """Migration step 1: stop the stream at a step boundary, hold its KV blocks."""

    stream: int
    migration: str


class Handoff(Message, frozen=True, tag="handoff"):
    """Answer to :class:`Release`: where the held KV is and how many tokens it covers.

    ``fusion``: the source's length-predictor state for the request (sum of
    weights, sum of weighted final lengths counted from the original prompt;
    ``workers.tap.HiddenStateTap.star_tap_state``), for the target's
    predictor to continue; None without one.
    """

    stream: int
    migration: str
    kv_transfer_params: dict[str, Any]
    num_tokens: Count
    fusion: list[float] | None = None


class Error(Message, frozen=True, tag="error"):
    """A stream failed on the worker; ``code`` is machine-readable (an :class:`ErrorCode`).

    ``code`` is a plain string on the wire, so that a code this side does not
    know yet still decodes; both sides compare it with :class:`ErrorCode`.
    """

    stream: int
    code: str
    message: str


CONNECTION_STREAM = -1
"""``Error.stream`` of an error about the connection rather than one stream."""


class ErrorCode(enum.StrEnum):
    """``Error.code`` values a worker sends."""

    BAD_FRAME = "bad_frame"  # undecodable, or a frame a proxy must not send
    FRAME_TOO_LARGE = "frame_too_large"  # the connection is closed after it
    DUPLICATE_STREAM = "duplicate_stream"  # Generate on a stream id still open
    UNKNOWN_STREAM = "unknown_stream"  # Release of a stream that is not open
    BAD_REQUEST = "bad_request"  # the engine refused the request (sampling, prompt)
    DUPLICATE_REQUEST = "duplicate_request"  # request id already running here
    UNSUPPORTED = "unsupported"  # the engine lacks the operation (e.g. a test fake's Release)
    NOT_RELEASABLE = "not_releasable"  # Release refused: unknown, finished, not migratable, ...
    ENGINE_ERROR = "engine_error"  # the engine failed this request
    ENGINE_DEAD = "engine_dead"  # the engine is gone; the worker will exit
    SHUTTING_DOWN = "shutting_down"  # the worker is draining and takes no new streams
    INTERNAL = "internal"  # a bug in the worker; logged there
    UNKNOWN_REQUEST = "unknown_request"  # Attach of a request this worker does not hold
    MOVED = "moved"  # another proxy attached the stream's request (Attach)


REFUSAL_CODES = frozenset(
    {
        ErrorCode.DUPLICATE_STREAM,
        ErrorCode.UNKNOWN_STREAM,
        ErrorCode.UNSUPPORTED,
        ErrorCode.NOT_RELEASABLE,
    }
)
"""Codes of an Error that refuses one frame and leaves the open stream of that id alone."""

RELEASE_REFUSALS = frozenset({ErrorCode.UNSUPPORTED, ErrorCode.NOT_RELEASABLE})
"""Codes of an Error that answers a :class:`Release` with no: the stream goes on where it is."""


def ends_stream(err: Error) -> bool:
    """Whether ``err`` is the final frame of its stream (most are; refusals are not)."""
    return err.stream != CONNECTION_STREAM and err.code not in REFUSAL_CODES


class Ping(Message, frozen=True, tag="ping"):
    """A heartbeat (either side, after a silence; :mod:`star.liveness`): answer with :class:`Pong`.

    A proxy sends one right after Hello: a worker starts its own liveness
    check on a connection only once it has seen a Ping there (an older proxy
    sends none), and an older worker answers it with a ``bad_frame``
    :class:`Error`, after which the proxy sends no more.
    """

    seq: int


class Pong(Message, frozen=True, tag="pong"):
    """The answer to :class:`Ping`, with its ``seq``."""

    seq: int


BUS_MESSAGES: tuple[type[Message], ...] = (Report, Decision, Event, LoadEntry)
FRAMES: tuple[type[Message], ...] = (
    Hello,
    Generate,
    ResumableGenerate,
    Attach,
    Attached,
    Tokens,
    LogprobTokens,
    PromptLogprobs,
    Abort,
    Release,
    Handoff,
    Error,
    Challenge,
    Answer,
    Accept,
    Ping,
    Pong,
)
for _cls in (*BUS_MESSAGES, *FRAMES):  # KIND: the tag, written once, in the class statement
    _cls.KIND = _cls.__struct_config__.tag  # type: ignore[assignment]
_BY_KIND: dict[str, type[Message]] = {cls.KIND: cls for cls in (*BUS_MESSAGES, *FRAMES)}

M = TypeVar("M", bound=Message)


# -- codec ------------------------------------------------------------------------


def _plain_float(obj: Any) -> Any:
    # msgspec writes only exact builtin types; msgpack wrote a float subclass
    # (numpy.float64, from the planner's arrays) as a float, and so does this.
    if isinstance(obj, float):
        return float(obj)
    raise TypeError(f"a wire message cannot hold a {type(obj).__name__}: {obj!r:.60}")


_ENCODER = msgspec.msgpack.Encoder(enc_hook=_plain_float)
_DECODER = msgspec.msgpack.Decoder(Union[(*BUS_MESSAGES, *FRAMES)])


def encode(msg: Message) -> bytes:
    """Encode a message as a versioned msgpack map."""
    return _ENCODER.encode(msg)


def decode(raw: bytes, expect: type[M] | tuple[type[M], ...] | None = None) -> Message:
    """Decode one message from msgpack bytes (strict; raises :class:`WireError`).

    ``expect``: the kinds the caller takes; another kind raises :class:`UnknownKind`.
    """
    try:
        msg: Message = _DECODER.decode(raw)
    except Exception as exc:  # msgspec's errors, and e.g. UnicodeDecodeError
        raise _explain(raw, expect, exc) from None
    v = msg.v
    if v.__class__ is not int or v != SCHEMA_VERSION:  # no ``v`` read, or another one
        raise _explain(raw, expect, None)
    if expect is not None and not isinstance(msg, expect):
        raise _explain(raw, expect, None)
    return msg


def decode_as(raw: bytes, cls: type[M]) -> M:
    """Decode and narrow the type: ``decode_as(raw, Report)``."""
    msg = decode(raw, cls)
    assert isinstance(msg, cls)
    return msg


# -- what was wrong -----------------------------------------------------------------
# Only a refused message comes here: its map is read again, untyped, for the
# header checks that come first (version, kind, the kinds expected) and for
# the value at fault; msgspec's own error says which field and why.

_ERROR = re.compile(r"(?s)(?P<what>.*?)(?: - at (?P<key>`key` in )?`\$(?P<path>[^`]*)`)?")
_STEP = re.compile(r"\.(\w+)|\[(\d+)\]")
_NAMES = {"int": "an integer", "float": "a number", "object": "a map", "array": "a list"}
_UNION_NAMES = {"null": "None", "object": "map", "array": "list"}
_NOTHING = object()


def _explain(raw: bytes, expect: Any, exc: Exception | None) -> WireError:
    """The :class:`WireError` that says why ``raw`` was refused."""
    try:
        data = msgspec.msgpack.decode(raw)
    except Exception as err:  # msgspec.DecodeError, UnicodeDecodeError, ...
        return BadEncoding(f"not msgpack ({type(err).__name__}: {err})")
    if not isinstance(data, dict):
        return BadEncoding(f"expected a msgpack map, got {type(data).__name__}")
    if "v" not in data:
        return MissingField("missing schema version 'v'")
    if data["v"] != SCHEMA_VERSION:
        return UnknownVersion(f"schema version {data['v']!r}, this build reads {SCHEMA_VERSION}")
    kind = data.get("k")
    cls = _BY_KIND.get(kind) if isinstance(kind, str) else None
    if cls is None:
        return UnknownKind(f"unknown message kind {kind!r}")
    if expect is not None:
        allowed = expect if isinstance(expect, tuple) else (expect,)
        if cls not in allowed:
            names = ", ".join(c.KIND for c in allowed)
            return UnknownKind(f"expected {names}, got {kind!r}")
    if exc is None:  # pragma: no cover (decode refuses nothing else without an error)
        return WireError(f"{kind}: refused")
    match = _ERROR.fullmatch(str(exc))
    assert match is not None  # the pattern matches any text
    what, suffix = match["what"], match["path"] or ""
    path = f"{kind}{suffix}"
    if not isinstance(exc, msgspec.ValidationError):  # valid msgpack, but not as typed
        return BadEncoding(f"{path}: {type(exc).__name__}: {exc}")
    if m := re.fullmatch(r"(?s)Object missing required field `(.*)`", what):
        return MissingField(f"{path}: missing field {m[1]!r}")
    if m := re.fullmatch(r"(?s)Object contains unknown field `(.*)`", what):
        return UnknownField(f"{path}: unknown field {m[1]!r}")
    value = _at(data, suffix)
    if match["key"]:  # a map's key that is not a str (a field name, or a key of a dict[str, Any])
        bad = (
            next((k for k in value if not isinstance(k, str)), _NOTHING)
            if isinstance(value, dict)
            else _NOTHING
        )
        return WrongType(f"{path}: a key is not a str: {_shown(bad)}")
    if m := re.fullmatch(r"(?s)Expected `([^`]*)`(.*?)(?:, got `[^`]*`)?", what):
        wanted = _NAMES.get(m[1]) or " | ".join(_UNION_NAMES.get(t, t) for t in m[1].split(" | "))
        return WrongType(f"{path}: expected {wanted}{m[2]}, got {_shown(value)}")
    if what.startswith("Invalid enum value"):
        types = {f.name: f.type for f in msgspec.structs.fields(cls)}
        enum_cls = types.get(suffix[1:])  # the one enum, Event.event, is a top-level field
        name = enum_cls.__name__ if isinstance(enum_cls, type) else "known value"
        return WrongType(f"{path}: {value!r:.60} is not a {name}")
    return WrongType(f"{path}: {what}")


def _at(data: Any, suffix: str) -> Any:
    """The value at msgspec's path ``suffix`` (``.requests[1].tokens``) in ``data``."""
    for name, index in _STEP.findall(suffix):
        try:
            data = data[name] if name else data[int(index)]
        except (KeyError, IndexError, TypeError):
            return _NOTHING
    return data


def _shown(value: Any) -> str:
    if value is _NOTHING:
        return "something else"
    if value is None:
        return "None"
    if isinstance(value, list | dict):
        return type(value).__name__
    return f"{type(value).__name__} {value!r:.60}"


# -- framing for the internal token protocol ---------------------------------------

_LEN = struct.Struct(">I")


def frame(msg: Message, seal: Callable[[bytes], bytes] | None = None) -> bytes:
    """Length-prefixed frame: 4-byte big-endian length, then the msgpack body (``seal``ed:
    the token protocol's channel after its handshake, :class:`star.handshake.Channel`)."""
    body = encode(msg) if seal is None else seal(encode(msg))
    return _LEN.pack(len(body)) + body


class FrameDecoder:
    """Sans-IO frame splitter: ``feed(bytes)`` returns complete messages.

    A frame that fails to decode raises :class:`WireError` after the frame is
    consumed, so the caller can answer with an :class:`Error` and go on; a
    frame over ``max_frame`` raises :class:`FrameTooLarge` and the connection
    must be closed (the stream position is lost).
    """

    def __init__(
        self, max_frame: int = MAX_FRAME_BYTES, opener: Callable[[bytes], bytes] | None = None
    ) -> None:
        self._buf = bytearray()
        self._max = max_frame
        # Unseals each body before decoding (whatever it raises ends the connection);
        # set once the handshake is done, frames still buffered included.
        self.opener = opener

    def feed(self, data: bytes) -> None:
        self._buf += data

    def __iter__(self) -> Iterator[Message]:
        return self

    def __next__(self) -> Message:
        if len(self._buf) < _LEN.size:
            raise StopIteration
        (size,) = _LEN.unpack_from(self._buf)
        if size > self._max:
            raise FrameTooLarge(f"frame of {size} bytes exceeds the {self._max}-byte limit")
        end = _LEN.size + size
        if len(self._buf) < end:
            raise StopIteration
        body = bytes(self._buf[_LEN.size : end])
        del self._buf[:end]
        if self.opener is not None:
            body = self.opener(body)
        return decode(body, FRAMES)

    @property
    def buffered(self) -> int:
        return len(self._buf)
