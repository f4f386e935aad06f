"""Every message STAR puts on a wire, defined once (docs/design.md §4).

Two families share one encoding, a msgpack map ``{"v": SCHEMA_VERSION, "k":
kind, ...fields}``:

* bus messages, the body of Redis stream entries: :class:`Report`,
  :class:`Decision`, :class:`Event`, and :class:`LoadEntry` (the values of the
  ``<prefix>:load`` hash);
* frames of the internal token protocol between proxy and workers (framed
  msgpack over TCP, multiplexed by ``stream``): :class:`Hello`,
  :class:`Generate`, :class:`Tokens`, :class:`Abort`, :class:`Release`,
  :class:`Handoff`, :class:`Error`, the heartbeats :class:`Ping` and
  :class:`Pong` (:mod:`star.liveness`), and the authentication handshake
  before Hello (:mod:`star.handshake`): :class:`Challenge`, :class:`Answer`,
  :class:`Accept`.

Decoding is strict: a wrong version, an unknown kind, a missing field, an
unknown field or a value of the wrong type raises a :class:`WireError`
subclass, never a half-built message. Encoding and decoding happen only at
the boundary (the bus adapter, the protocol reader); the rest of the code
passes these dataclasses around.
"""

from __future__ import annotations

import dataclasses
import enum
import operator
import struct
import time
import types
import typing
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, ClassVar, TypeVar

import msgpack
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


class Message:
    """Base of every top-level message; subclasses set ``KIND``."""

    KIND: ClassVar[str] = ""

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


@dataclass(frozen=True, slots=True)
class RequestLoad:
    """One running request inside a :class:`Report`."""

    id: str
    tokens: int  # N(r): prompt + generated tokens in the KV cache
    generated: int
    predicted_remaining: float | None = None  # R-hat(r); None before the first prediction
    migratable: bool = True
    # Tokens it has left to generate when its length is fixed (ignore_eos with
    # max_tokens, no stop condition: workers.state.length_budget); None: not known.
    true_remaining: int | None = None


@dataclass(frozen=True, slots=True)
class Report(Message):
    """A worker's periodic state report (``<prefix>:reports``)."""

    KIND: ClassVar[str] = "report"
    instance: str
    role: str
    seq: int
    ts: float
    address: str  # host:port of its internal token protocol
    capacity_tokens: int
    used_tokens: int
    bytes_per_token: int
    step_time_s: float  # mean decode step time since the last report
    delta: int  # decode steps between trace points
    trace: list[float]  # L(tau_0..tau_H), the worker's pre-simulated load
    requests: list[RequestLoad]
    in_flight: list[str] = field(default_factory=list)
    waiting: int = 0
    preemptions: int = 0
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
    refused_peers: int = 0

    def summary(self) -> dict[str, str]:
        return {"kind": self.KIND, "instance": self.instance, "load": str(self.used_tokens)}


@dataclass(frozen=True, slots=True)
class Decision(Message):
    """Migrate ``request`` from ``source`` to ``target`` (``<prefix>:decisions``)."""

    KIND: ClassVar[str] = "decision"
    id: str
    request: str
    source: str
    target: str
    tick: int
    delta_v: float
    mode: str
    ts: float
    fence: int = 0  # leader's fencing token; 0 for manual decisions
    origin: str = "scheduler"  # or "manual" (star migrate)
    reason: str = "balance"  # Algorithm 1's; "drain": the source is draining (star.planner.drain)

    def summary(self) -> dict[str, str]:
        return {
            "kind": self.KIND,
            "request": self.request,
            "source": self.source,
            "target": self.target,
        }


@dataclass(frozen=True, slots=True)
class Event(Message):
    """A lifecycle event (``<prefix>:events``)."""

    KIND: ClassVar[str] = "event"
    event: EventKind
    ts: float
    origin: str  # who says it: an instance id, "proxy:<id>" or "scheduler:<id>"
    request: str = ""
    migration: str = ""
    instance: str = ""
    detail: str = ""
    data: dict[str, Any] = field(default_factory=dict)

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


@dataclass(frozen=True, slots=True)
class LoadEntry(Message):
    """One decode instance in the dispatch view (``<prefix>:load`` hash)."""

    KIND: ClassVar[str] = "load"
    instance: str
    role: str
    address: str
    tokens: int
    capacity_tokens: int
    workload: float
    running: int
    ts: float


# -- internal token protocol frames ----------------------------------------------


@dataclass(frozen=True, slots=True)
class Challenge(Message):
    """First frame of a worker that has a cluster secret: a fresh random nonce."""

    KIND: ClassVar[str] = "challenge"
    nonce: bytes


@dataclass(frozen=True, slots=True)
class Answer(Message):
    """The proxy's reply to :class:`Challenge`: its proof, and its own nonce for the worker."""

    KIND: ClassVar[str] = "answer"
    proof: bytes
    nonce: bytes


@dataclass(frozen=True, slots=True)
class Accept(Message):
    """The worker's proof of the secret over the proxy's nonce; Hello follows."""

    KIND: ClassVar[str] = "accept"
    proof: bytes


@dataclass(frozen=True, slots=True)
class Hello(Message):
    """First frame a worker sends on a new connection."""

    KIND: ClassVar[str] = "hello"
    instance: str
    role: str
    model: str


@dataclass(frozen=True, slots=True)
class Generate(Message):
    """Start (or continue, after a handoff) a request on a worker.

    ``continued``: on a continuation, how many tokens the request had already
    generated; they end ``prompt_token_ids`` (0 for a fresh request).
    ``fusion``: on a continuation, the length predictor's state the source
    handed over (:class:`Handoff`), or None.
    """

    KIND: ClassVar[str] = "generate"
    stream: int
    request_id: str
    prompt_token_ids: list[int]
    sampling: dict[str, Any]  # vLLM SamplingParams keyword arguments
    kv_transfer_params: dict[str, Any] | None = None
    continued: int = 0
    fusion: list[float] | None = None


@dataclass(frozen=True, slots=True)
class Tokens(Message):
    """New output tokens of a stream; ``finish_reason`` set on the last frame."""

    KIND: ClassVar[str] = "tokens"
    stream: int
    token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    kv_transfer_params: dict[str, Any] | None = None
    num_prompt_tokens: int = 0


@dataclass(frozen=True, slots=True)
class Abort(Message):
    """The client went away: stop the stream and free its KV."""

    KIND: ClassVar[str] = "abort"
    stream: int


@dataclass(frozen=True, slots=True)
class Release(Message):
    """Migration step 1: stop the stream at a step boundary, hold its KV blocks."""

    KIND: ClassVar[str] = "release"
    stream: int
    migration: str


@dataclass(frozen=True, slots=True)
class Handoff(Message):
    """Answer to :class:`Release`: where the held KV is and how many tokens it covers.

    ``fusion``: the source's length-predictor state for the request (sum of
    weights, sum of weighted final lengths counted from the original prompt;
    ``workers.tap.HiddenStateTap.star_tap_state``), for the target's
    predictor to continue; None without one.
    """

    KIND: ClassVar[str] = "handoff"
    stream: int
    migration: str
    kv_transfer_params: dict[str, Any]
    num_tokens: int
    fusion: list[float] | None = None


@dataclass(frozen=True, slots=True)
class Error(Message):
    """A stream failed on the worker; ``code`` is machine-readable (an :class:`ErrorCode`).

    ``code`` is a plain string on the wire, so that a code this side does not
    know yet still decodes; both sides compare it with :class:`ErrorCode`.
    """

    KIND: ClassVar[str] = "error"
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


@dataclass(frozen=True, slots=True)
class Ping(Message):
    """A heartbeat (either side, after a silence; :mod:`star.liveness`): answer with :class:`Pong`.

    A proxy sends one right after Hello: a worker starts its own liveness
    check on a connection only once it has seen a Ping there (an older proxy
    sends none), and an older worker answers it with a ``bad_frame``
    :class:`Error`, after which the proxy sends no more.
    """

    KIND: ClassVar[str] = "ping"
    seq: int


@dataclass(frozen=True, slots=True)
class Pong(Message):
    """The answer to :class:`Ping`, with its ``seq``."""

    KIND: ClassVar[str] = "pong"
    seq: int


BUS_MESSAGES: tuple[type[Message], ...] = (Report, Decision, Event, LoadEntry)
FRAMES: tuple[type[Message], ...] = (
    Hello,
    Generate,
    Tokens,
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
_BY_KIND: dict[str, type[Message]] = {cls.KIND: cls for cls in (*BUS_MESSAGES, *FRAMES)}

M = TypeVar("M", bound=Message)
T = TypeVar("T")


# -- strict codec -----------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Field:
    name: str
    tp: Any
    required: bool


_SCHEMAS: dict[type[Any], tuple[_Field, ...]] = {}


def _schema(cls: type[Any]) -> tuple[_Field, ...]:
    cached = _SCHEMAS.get(cls)
    if cached is None:
        hints = typing.get_type_hints(cls)
        cached = tuple(
            _Field(
                f.name,
                hints[f.name],
                f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING,
            )
            for f in dataclasses.fields(cls)
        )
        _SCHEMAS[cls] = cached
    return cached


def _to_plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _to_plain(getattr(value, f.name)) for f in _schema(type(value))}
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, list | tuple):
        return [_to_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _to_plain(v) for k, v in value.items()}
    return value


_SCALARS = (str, int, float, bool)
_FLAT: dict[type[Any], tuple[tuple[str, ...], Callable[[Any], tuple[Any, ...]]] | None] = {}


def _flat(cls: type[Any]) -> tuple[tuple[str, ...], Callable[[Any], tuple[Any, ...]]] | None:
    """Field names and one getter for a message of scalar fields only (None: not one).

    Such a message's map is its field values as they are (:func:`_to_plain`
    returns scalars unchanged), read in one C call: the scheduler encodes
    ~1,000 :class:`LoadEntry` per tick.
    """
    try:
        return _FLAT[cls]
    except KeyError:
        fields = _schema(cls)
        flat = None
        if len(fields) >= 2 and all(f.tp in _SCALARS for f in fields):
            names = tuple(f.name for f in fields)
            flat = (names, operator.attrgetter(*names))
        _FLAT[cls] = flat
        return flat


def encode(msg: Message) -> bytes:
    """Encode a message as a versioned msgpack map."""
    flat = _flat(type(msg))
    if flat is not None:
        body = dict(zip(flat[0], flat[1](msg), strict=True))
    else:
        body = _to_plain(msg)
    body["v"] = SCHEMA_VERSION
    body["k"] = msg.KIND
    return msgpack.packb(body, use_bin_type=True)  # type: ignore[no-any-return]


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _check(tp: Any, value: Any, path: str) -> Any:
    """Validate ``value`` against ``tp`` and build nested dataclasses/enums."""
    if tp is Any:
        return value
    origin = typing.get_origin(tp)
    if origin in {types.UnionType, typing.Union}:
        args = typing.get_args(tp)
        if value is None:
            if type(None) in args:
                return None
            raise WrongType(f"{path}: expected {_type_name(tp)}, got None")
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _check(arg, value, path)
            except WrongType:
                continue
        raise WrongType(
            f"{path}: expected {_type_name(tp)}, got {type(value).__name__} {value!r:.60}"
        )
    if origin is list:
        if not isinstance(value, list):
            raise WrongType(f"{path}: expected a list, got {type(value).__name__}")
        (item,) = typing.get_args(tp)
        return [_check(item, v, f"{path}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise WrongType(f"{path}: expected a map, got {type(value).__name__}")
        key_tp, val_tp = typing.get_args(tp)
        return {
            _check(key_tp, k, f"{path} key"): _check(val_tp, v, f"{path}[{k!r}]")
            for k, v in value.items()
        }
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        try:
            return tp(value)
        except ValueError:
            raise WrongType(f"{path}: {value!r} is not a {tp.__name__}") from None
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise WrongType(f"{path}: expected a map, got {type(value).__name__}")
        return _build(tp, value, path)  # type: ignore[arg-type]
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise WrongType(f"{path}: expected a number, got {type(value).__name__} {value!r:.60}")
        return float(value)
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise WrongType(
                f"{path}: expected an integer, got {type(value).__name__} {value!r:.60}"
            )
        return value
    if tp in {str, bool, bytes}:
        if not isinstance(value, tp):
            raise WrongType(
                f"{path}: expected {tp.__name__}, got {type(value).__name__} {value!r:.60}"
            )
        return value
    raise TypeError(f"wire schema uses unsupported type {tp!r} at {path}")


def _build(
    cls: type[Any], data: dict[Any, Any], path: str, skip: frozenset[str] = frozenset()
) -> Any:
    kwargs: dict[str, Any] = {}
    schema = _schema(cls)
    for f in schema:
        if f.name not in data:
            if f.required:
                raise MissingField(f"{path}: missing field {f.name!r}")
            continue
        kwargs[f.name] = _check(f.tp, data[f.name], f"{path}.{f.name}")
    known = {f.name for f in schema} | skip
    extra = [k for k in data if k not in known]
    if extra:
        raise UnknownField(f"{path}: unknown field(s) {', '.join(map(repr, extra))}")
    return cls(**kwargs)


# -- compiled decoders --------------------------------------------------------------
# ``_build`` / ``_check`` walk the schema generically and say exactly what is
# wrong, but cost ~20x the unpacking (the scheduler decodes thousands of
# 64-request reports a second). So every message class also gets a decoder
# generated once from its fields: straight-line code that accepts only input
# ``_build`` accepts and builds the same message, and gives up (``_Reject`` or
# any exception) on everything else, for ``_build`` to rerun and raise the
# typed error with its path. tests/fuzz/test_wire_fuzz.py checks the two agree.

_HEADER = frozenset({"v", "k"})
_STR_ONLY = frozenset({str})
_NUMBERS = frozenset({float, int})
_EXACT = {int: "int", str: "str", bool: "bool", bytes: "bytes"}


class _Reject(Exception):
    """The compiled decoder does not take this input; the reference walk decides."""


def _convert(tp: Any, src: str, dst: str, ind: str, ns: dict[str, Any]) -> list[str]:
    """Lines that check ``src`` against ``tp`` and set ``dst`` (as ``_check`` would)."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if tp is Any:
        return [f"{ind}{dst} = {src}"]
    if tp in _EXACT:  # msgpack builds exact types; a subclass goes the reference way
        return [f"{ind}if type({src}) is not {_EXACT[tp]}: raise _Reject", f"{ind}{dst} = {src}"]
    if tp is float:
        return [
            f"{ind}if type({src}) is float: {dst} = {src}",
            f"{ind}elif type({src}) is int: {dst} = float({src})",
            f"{ind}else: raise _Reject",
        ]
    if origin in {types.UnionType, typing.Union} and len(args) == 2 and type(None) in args:
        (inner,) = (a for a in args if a is not type(None))
        return [
            f"{ind}if {src} is None: {dst} = None",
            f"{ind}else:",
            *_convert(inner, src, dst, ind + "    ", ns),
        ]
    if origin is list and args[0] in _EXACT:
        name = f"_only_{_EXACT[args[0]]}"
        ns[name] = frozenset(args)
        return [
            f"{ind}if type({src}) is not list or not set(map(type, {src})) <= {name}:",
            f"{ind}    raise _Reject",
            f"{ind}{dst} = list({src})",
        ]
    if origin is list and args[0] is float:
        return [
            f"{ind}if type({src}) is not list or not set(map(type, {src})) <= _NUMBERS:",
            f"{ind}    raise _Reject",
            f"{ind}{dst} = list(map(float, {src}))",
        ]
    if origin is list and dataclasses.is_dataclass(args[0]):
        name = f"_decode_{args[0].__name__}"
        ns[name] = _DECODERS.get(args[0]) or _compile(args[0])
        return [
            f"{ind}if type({src}) is not list: raise _Reject",
            f"{ind}{dst} = [{name}(i) for i in {src}]",
        ]
    if origin is dict and args == (str, Any):
        return [
            f"{ind}if type({src}) is not dict or not set(map(type, {src})) <= _STR_ONLY:",
            f"{ind}    raise _Reject",
            f"{ind}{dst} = dict({src})",
        ]
    if dataclasses.is_dataclass(tp) or (isinstance(tp, type) and issubclass(tp, enum.Enum)):
        name = f"_build_{tp.__name__}"
        # An enum's constructor raises ValueError on a value it does not define.
        ns[name] = tp if not dataclasses.is_dataclass(tp) else _DECODERS.get(tp) or _compile(tp)
        return [f"{ind}{dst} = {name}({src})"]
    # Anything rarer (a union of several types): the reference check, without a path.
    name = f"_tp{len(ns)}"
    ns[name] = tp
    return [f"{ind}{dst} = _check({name}, {src}, '')"]


def _slot_setters(cls: type[Any]) -> list[Any] | None:
    """The slot setters of ``cls``'s fields, in order, when its ``__init__`` is a
    dataclass's that only assigns them (every field in ``__init__``, no
    ``__post_init__``, every field a slot); None otherwise (build via ``cls``)."""
    if hasattr(cls, "__post_init__"):
        return None
    setters = []
    for f in dataclasses.fields(cls):
        slot = next((c.__dict__[f.name] for c in cls.__mro__ if f.name in c.__dict__), None)
        if not f.init or not isinstance(slot, types.MemberDescriptorType):
            return None
        setters.append(slot.__set__)
    return setters


def _build_lines(cls: type[Any], ns: dict[str, Any], ind: str) -> list[str]:
    """Generated lines that return a ``cls`` from locals ``a0, a1, ...`` (all its
    field values in order): each set through its slot setter where
    :func:`_slot_setters` allows (a frozen dataclass's ``__init__`` sets each
    through ``object.__setattr__``: ~2.5x the cost; 678 -> 406 ns for a
    RequestLoad, 64 of them in each report), else ``cls(...)``. ``ns`` gets the
    names the lines use."""
    setters = _slot_setters(cls)
    ns["cls"] = cls
    if setters is None:
        args = ", ".join(f"a{i}" for i in range(len(dataclasses.fields(cls))))
        return [f"{ind}return cls({args})"]
    ns["_new"] = object.__new__
    lines = [f"{ind}o = _new(cls)"]
    for i, setter in enumerate(setters):
        ns[f"_set{i}"] = setter
        lines.append(f"{ind}_set{i}(o, a{i})")
    return [*lines, f"{ind}return o"]


def slot_builder(cls: type[T]) -> Callable[..., T]:
    """``make(*values)``: a ``cls`` from all its field values in order, built as
    the compiled decoders build it (:func:`_build_lines`); ``cls`` itself when
    its slots cannot be set directly."""
    if _slot_setters(cls) is None:
        return cls
    ns: dict[str, Any] = {}
    args = ", ".join(f"a{i}" for i in range(len(dataclasses.fields(cls))))
    lines = [f"def make({args}):", *_build_lines(cls, ns, "    ")]
    exec("\n".join(lines), ns)  # code generated from the fields above
    return ns["make"]  # type: ignore[no-any-return]


def _compile(cls: type[Any]) -> Any:
    """``decode(data, header)``: ``cls`` from its plain map, which holds ``header``
    keys (the version and kind) besides the fields; raises on anything else."""
    ns: dict[str, Any] = {"_Reject": _Reject, "_check": _check}
    ns.update(cls=cls, _NUMBERS=_NUMBERS, _STR_ONLY=_STR_ONLY)
    schema = _schema(cls)
    lines = [
        "def decode(d, header=0):",
        "    if type(d) is not dict: raise _Reject",
        f"    n = header + {sum(f.required for f in schema)}  # keys read: the required ones, ...",
    ]
    defaults = {f.name: f for f in dataclasses.fields(cls)}
    for i, f in enumerate(schema):
        if f.required:  # missing: KeyError, and the reference walk says which
            lines += [f"    x = d[{f.name!r}]", *_convert(f.tp, "x", f"a{i}", "    ", ns)]
            continue
        default = defaults[f.name]
        if default.default_factory is not dataclasses.MISSING:
            ns[f"_default{i}"] = default.default_factory
            fill = f"_default{i}()"
        else:
            ns[f"_default{i}"] = default.default
            fill = f"_default{i}"
        # ``in`` and a subscript: cheaper than a ``d.get`` call in CPython 3.11
        lines += [f"    if {f.name!r} not in d: a{i} = {fill}", "    else:"]
        lines += [
            f"        x = d[{f.name!r}]",
            "        n += 1  # ... and the optional ones present",
        ]
        lines += _convert(f.tp, "x", f"a{i}", "        ", ns)
    lines.append("    if len(d) != n: raise _Reject  # an unknown field")
    lines += _build_lines(cls, ns, "    ")
    exec("\n".join(lines), ns)  # code generated from the schema above
    _DECODERS[cls] = ns["decode"]
    return ns["decode"]


_DECODERS: dict[type[Any], Any] = {}
for _cls in _BY_KIND.values():
    _compile(_cls)


def decode_plain(data: Any, expect: type[M] | tuple[type[M], ...] | None = None) -> Message:
    """Decode an already-unpacked msgpack map (strict)."""
    if not isinstance(data, dict):
        raise BadEncoding(f"expected a msgpack map, got {type(data).__name__}")
    if "v" not in data:
        raise MissingField("missing schema version 'v'")
    if data["v"] != SCHEMA_VERSION:
        raise UnknownVersion(f"schema version {data['v']!r}, this build reads {SCHEMA_VERSION}")
    kind = data.get("k")
    cls = _BY_KIND.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise UnknownKind(f"unknown message kind {kind!r}")
    if expect is not None:
        allowed = expect if isinstance(expect, tuple) else (expect,)
        if cls not in allowed:
            names = ", ".join(c.KIND for c in allowed)
            raise UnknownKind(f"expected {names}, got {kind!r}")
    try:
        return _DECODERS[cls](data, 2)  # type: ignore[no-any-return]
    except Exception:  # rejected: the reference walk raises the typed error
        return _build(cls, data, cls.KIND, skip=_HEADER)  # type: ignore[no-any-return]


# -- the fast path: msgspec ---------------------------------------------------------
#
# msgspec decodes msgpack straight into the dataclasses (~4x faster than
# unpacking to dicts and building them: 54 against 194 us for a 64-request
# Report), type-checked as strictly as :func:`_check` (ints for floats are
# converted, bools are not numbers), but it skips unknown keys. So a second
# msgspec pass reads only the keys, into generated Structs that forbid unknown
# fields and leave every value unread (``msgspec.Raw``) but nested messages'
# maps; it also yields the header (``v``, and ``k`` as the Struct's tag). Both
# passes: ~85 us. Whatever either pass refuses goes to the strict path below,
# which decides: the same message, or the typed error with its message.


def _keys_type(tp: Any) -> Any:
    """What the keys pass reads for a field of type ``tp``: nested messages'
    keys (through lists, optionals and map values), ``Raw`` elsewhere."""
    if dataclasses.is_dataclass(tp):
        return _keys_struct(tp, top=False)  # type: ignore[arg-type]
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin is list:
        item: Any = _keys_type(args[0])
        return msgspec.Raw if item is msgspec.Raw else list[item]
    if origin is dict:
        value: Any = _keys_type(args[1])
        return msgspec.Raw if value is msgspec.Raw else dict[str, value]
    if origin in {types.UnionType, typing.Union}:
        others = [a for a in args if a is not type(None)]
        nested = [_keys_type(a) for a in others]
        if all(n is msgspec.Raw for n in nested):
            return msgspec.Raw
        if len(others) == 1 and len(args) == 2:
            return nested[0] | None
        raise TypeError(f"wire schema: a union of messages is not supported: {tp!r}")
    return msgspec.Raw


_KEYS: dict[tuple[type[Any], bool], type[msgspec.Struct]] = {}


def _keys_struct(cls: type[Any], top: bool) -> type[msgspec.Struct]:
    """A Struct with ``cls``'s field names that forbids any other key; ``top``:
    also the header, ``v`` as a field and ``k`` as the tag (the message kind)."""
    cached = _KEYS.get((cls, top))
    if cached is None:
        fields: list[tuple[str, Any, Any]] = [
            (f.name, _keys_type(f.tp), None) for f in _schema(cls)
        ]
        if top:
            fields.append(("v", int | None, None))
        cached = msgspec.defstruct(
            f"_{cls.__name__}Keys",
            fields,
            forbid_unknown_fields=True,
            gc=False,
            **({"tag_field": "k", "tag": cls.KIND} if top else {}),
        )
        _KEYS[(cls, top)] = cached
    return cached


_KEYS_OF: dict[type[msgspec.Struct], type[Message]] = {
    _keys_struct(cls, top=True): cls for cls in _BY_KIND.values()
}
_READ_KEYS = msgspec.msgpack.Decoder(typing.Union[tuple(_KEYS_OF)])  # noqa: UP007 (a runtime tuple)


def _holds_any(tp: Any) -> bool:
    """Whether a value of type ``tp`` may hold ``Any``: msgspec decodes such
    values its own way (msgpack extensions, timestamps, non-str keys)."""
    if tp is Any:
        return True
    if dataclasses.is_dataclass(tp):
        return any(_holds_any(f.tp) for f in _schema(tp))  # type: ignore[arg-type]
    return any(_holds_any(a) for a in typing.get_args(tp))


# Messages with ``Any`` in them (Event.data, Handoff's KV parameters) take the
# strict path only.
_READ: dict[type[Message], msgspec.msgpack.Decoder[Any]] = {
    cls: msgspec.msgpack.Decoder(cls) for cls in _BY_KIND.values() if not _holds_any(cls)
}
_FAST_KINDS: dict[Any, tuple[type[Message], ...] | None] = {}


def _fast_kinds(expect: Any) -> tuple[type[Message], ...] | None:
    """The expected classes when msgspec reads every one of them, else None
    (worked out once per ``expect``: decode is called for every frame)."""
    try:
        return _FAST_KINDS[expect]
    except KeyError:
        allowed = expect if isinstance(expect, tuple) else (expect,)
        fast = allowed if all(cls in _READ for cls in allowed) else None
        _FAST_KINDS[expect] = fast
        return fast


def _decode_fast(raw: bytes, expect: type[M] | tuple[type[M], ...] | None) -> Message | None:
    """The message, or None where the strict path must decide (it raises, or
    takes what msgspec does not: nothing it accepts is refused here). Tried
    only where every expected class has a reader (a Report from the bus, yes;
    a token-protocol frame, which may be Tokens or Generate, no)."""
    allowed = _fast_kinds(expect)
    if allowed is None:
        return None
    try:
        keys = _READ_KEYS.decode(raw)
        cls = _KEYS_OF[type(keys)]
        if cls not in allowed or keys.v != SCHEMA_VERSION:
            return None
        return _READ[cls].decode(raw)  # type: ignore[no-any-return]
    except Exception:  # msgspec's errors, and e.g. UnicodeDecodeError: the strict path says
        return None


def decode(raw: bytes, expect: type[M] | tuple[type[M], ...] | None = None) -> Message:
    """Decode one message from msgpack bytes (strict; raises :class:`WireError`)."""
    msg = _decode_fast(raw, expect)
    return msg if msg is not None else _decode_strict(raw, expect)


def _decode_strict(raw: bytes, expect: type[M] | tuple[type[M], ...] | None) -> Message:
    try:
        data = msgpack.unpackb(raw, raw=False, strict_map_key=False)
    except Exception as exc:  # msgpack raises several unrelated types
        raise BadEncoding(f"not msgpack ({type(exc).__name__}: {exc})") from None
    return decode_plain(data, expect)


def decode_as(raw: bytes, cls: type[M]) -> M:
    """Decode and narrow the type: ``decode_as(raw, Report)``."""
    msg = decode(raw, cls)
    assert isinstance(msg, cls)
    return msg


# -- framing for the internal token protocol ---------------------------------------

_LEN = struct.Struct(">I")


def frame(msg: Message) -> bytes:
    """Length-prefixed frame: 4-byte big-endian length, then the msgpack body."""
    body = encode(msg)
    return _LEN.pack(len(body)) + body


class FrameDecoder:
    """Sans-IO frame splitter: ``feed(bytes)`` returns complete messages.

    A frame that fails to decode raises :class:`WireError` after the frame is
    consumed, so the caller can answer with an :class:`Error` and go on; a
    frame over ``max_frame`` raises :class:`FrameTooLarge` and the connection
    must be closed (the stream position is lost).
    """

    def __init__(self, max_frame: int = MAX_FRAME_BYTES) -> None:
        self._buf = bytearray()
        self._max = max_frame

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
        return decode(body, FRAMES)

    @property
    def buffered(self) -> int:
        return len(self._buf)
