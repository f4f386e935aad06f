"""D->D migration in the proxy, as a machine: one request's decode run across NIXL handoffs.

The sans-IO core of paper §5.4 (docs/design.md §5): the lifecycle is the table
:data:`TRANSITIONS` (an illegal step raises :class:`IllegalTransition`), and
:class:`RunMachine` takes inputs (a decision, a frame, a lost connection, a
timeout, a leg opened or not) and returns actions (open or close a leg, send
a Release, deliver tokens, emit an event, fail); no IO, no clock.
:mod:`proxy.decode_run` drives it. Contract: the client's stream stays open
and each token index is delivered once. The steps and every failure outcome
are in ``docs/migration.md``.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Protocol

from proxy.backend import BackendError, FinishReason, TokenBatch, error_from
from star.sampling import continuation
from star.transitions import IllegalTransition as IllegalTransition
from star.transitions import stepper
from star.wire import (
    RELEASE_REFUSALS,
    Decision,
    Error,
    ErrorCode,
    EventKind,
    Generate,
    Handoff,
    LogprobTokens,
    PromptLogprobs,
    Tokens,
)

RELEASE_TIMEOUT_S = 10.0
MAX_RECOVERIES = 3
# The finish reasons a client may see; another (vLLM's "error") fails the request.
_FINISH_REASONS: dict[str, FinishReason] = {"stop": "stop", "length": "length", "abort": "abort"}


def _batch(
    msg: Tokens, reason: FinishReason | None = None, stop_reason: str | int | None = None
) -> TokenBatch:
    """The batch a Tokens frame delivers (its logprobs too, on a LogprobTokens)."""
    if isinstance(msg, LogprobTokens):
        return TokenBatch(
            list(msg.token_ids),
            reason,
            stop_reason,
            logprobs=list(msg.logprobs),
            top_ids=list(msg.top_ids),
            top_logprobs=list(msg.top_logprobs),
        )
    return TokenBatch(list(msg.token_ids), reason, stop_reason)


def leg_frame(
    stream: int,
    request_id: str,
    prompt: list[int],
    sampling: dict[str, Any],
    generated: list[int],
    kv: dict[str, Any] | None,
    fusion: list[float] | None = None,
) -> Generate:
    """The Generate that opens a leg: the first, or a continuation after ``generated`` tokens.

    A continuation is sent as a true one (``resume``, docs/design.md §5.2):
    its prompt is the original prompt plus every token sent, of which the
    last ``continued`` are the request's outputs so far, with the request's
    own sampling and budgets; the target makes them its output tokens (or,
    with ``worker.true_continuation`` off, re-submits them as prompt with the
    budgets reduced, :func:`star.sampling.continuation`). ``continued`` is also
    read by the target's predictor tap (its first row there is mid-answer),
    which continues the source's predictor state (``fusion``, from the
    :class:`Handoff`).
    """
    if not generated:
        return Generate(stream, request_id, list(prompt), sampling, kv)
    continuation(sampling, len(generated))  # raises when nothing is left to generate
    return Generate(
        stream,
        request_id,
        list(prompt) + generated,
        sampling,
        kv,
        continued=len(generated),
        fusion=fusion,
        resume=True,
    )


class RunState(enum.StrEnum):
    DECODING = "decoding"  # tokens flow from one instance
    RELEASING = "releasing"  # Release sent; tokens may still come
    RESUMING = "resuming"  # continued elsewhere; waiting for its first token
    DONE = "done"  # finished (any reason)


class RunEvent(enum.StrEnum):
    MIGRATE = "migrate"  # a decision starts (only when refusal() has none: DECODING)
    TOKENS = "tokens"  # tokens from the current leg
    REFUSED = "refused"  # the source cannot release it (the stream goes on)
    HANDOFF = "handoff"  # the source released it with its KV held
    RESUMED = "resumed"  # first token from the target
    SOURCE_LOST = "source_lost"  # ABORTED_SRC: the source went away
    RELEASE_TIMEOUT = "release_timeout"  # ABORTED_SRC: no Handoff in time
    TARGET_LOST = "target_lost"  # ABORTED_DST: target unreachable or failed before a token
    RECOVERED = "recovered"  # continued by recompute elsewhere
    FINISH = "finish"  # final tokens, error, or the client went away


TRANSITIONS: dict[tuple[RunState, RunEvent], RunState] = {
    (RunState.DECODING, RunEvent.MIGRATE): RunState.RELEASING,
    (RunState.DECODING, RunEvent.TOKENS): RunState.DECODING,
    (RunState.DECODING, RunEvent.SOURCE_LOST): RunState.RESUMING,
    (RunState.DECODING, RunEvent.FINISH): RunState.DONE,
    (RunState.RELEASING, RunEvent.TOKENS): RunState.RELEASING,
    (RunState.RELEASING, RunEvent.REFUSED): RunState.DECODING,
    (RunState.RELEASING, RunEvent.HANDOFF): RunState.RESUMING,
    (RunState.RELEASING, RunEvent.SOURCE_LOST): RunState.RESUMING,
    (RunState.RELEASING, RunEvent.RELEASE_TIMEOUT): RunState.RESUMING,
    (RunState.RELEASING, RunEvent.FINISH): RunState.DONE,
    (RunState.RESUMING, RunEvent.TOKENS): RunState.RESUMING,  # an empty frame
    (RunState.RESUMING, RunEvent.RESUMED): RunState.DECODING,
    (RunState.RESUMING, RunEvent.TARGET_LOST): RunState.RESUMING,
    (RunState.RESUMING, RunEvent.RECOVERED): RunState.RESUMING,
    (RunState.RESUMING, RunEvent.FINISH): RunState.DONE,
}


next_state = stepper("decode run", TRANSITIONS)
"""The state after an event; one that cannot happen raises IllegalTransition (a proxy bug)."""


class RunView(Protocol):
    """What :func:`refusal` reads of a run."""

    @property
    def state(self) -> RunState: ...
    @property
    def instance(self) -> str: ...
    @property
    def blocker(self) -> str | None: ...


def refusal(
    run: RunView | None, decision: Decision, finished: bool, live: bool = True
) -> str | None:
    """Why this proxy cannot start ``decision`` (None: it can): every reason, in order.

    ``run`` is the request's (None: this proxy runs none; ``finished``: it did);
    ``live``: the target is a live decode instance.
    """
    if run is None:
        return "finished" if finished else "unknown request"
    if run.blocker is not None:
        return f"not migratable: {run.blocker}"
    if not run.instance:
        return "not decoding yet"
    if run.state is not RunState.DECODING:
        return "already migrating"
    if decision.target == run.instance:
        return "already on the target"
    if decision.source and decision.source != run.instance:
        return f"not on {decision.source} (on {run.instance})"
    if not live:
        return f"target {decision.target} is not a live decode instance"
    return None


def refused(
    run: RunView | None, decision: Decision, finished: bool, address: str | None
) -> Emit | None:
    """The ``refused`` event of ``decision`` (None: ``run`` can start it now).

    ``address`` is the target's (None: not a live decode instance). The one
    place a decision is refused: :class:`proxy.decode_run.Migrator` for a
    request with no run, :meth:`RunMachine.refuses` for one with a run.
    """
    reason = refusal(run, decision, finished, live=address is not None)
    if reason is None:
        return None
    instance = run.instance if run is not None else decision.source
    return Emit(EventKind.REFUSED, reason, instance, decision.id, {"target": decision.target})


# -- inputs: what happened (times are time.monotonic(), read by the driver) ------------


@dataclass(frozen=True, slots=True)
class Start:
    """Open the first leg on ``instance`` (the decode dispatch's pick)."""

    instance: str
    address: str
    kv: dict[str, Any] | None


@dataclass(frozen=True, slots=True)
class Decided:
    """A decision for this request, received at ``since`` (the machine may still refuse it)."""

    decision: Decision
    address: str | None  # the target's (None: not a live decode instance)
    since: float


@dataclass(frozen=True, slots=True)
class Received:
    """A frame of the current leg, received at ``now``."""

    msg: Tokens | Handoff | Error | PromptLogprobs
    now: float


@dataclass(frozen=True, slots=True)
class Lost:
    """The current leg's connection went away."""

    why: str


@dataclass(frozen=True, slots=True)
class TimedOut:
    """No Handoff by :meth:`RunMachine.deadline`."""


@dataclass(frozen=True, slots=True)
class Opened:
    """The leg of the last :class:`OpenLeg` is open (its Generate sent)."""


@dataclass(frozen=True, slots=True)
class OpenFailed:
    """The leg of the last :class:`OpenLeg` could not be opened."""

    why: str


@dataclass(frozen=True, slots=True)
class Candidates:
    """The answer to :class:`ListCandidates`: live decode instances as (instance, address)."""

    members: tuple[tuple[str, str], ...]


@dataclass(frozen=True, slots=True)
class Ended:
    """The driver is done with the run: it finished, failed, or the client went away."""


Input = Start | Decided | Received | Lost | TimedOut | Opened | OpenFailed | Candidates | Ended


# -- actions: what to do, in order ------------------------------------------------------


@dataclass(frozen=True, slots=True)
class OpenLeg:
    """Open a stream to ``address``, send it :meth:`frame`; answer Opened or OpenFailed."""

    instance: str
    address: str
    request_id: str
    prompt: list[int]
    sampling: dict[str, Any]
    generated: list[int]  # every token the client has been sent: the leg continues after them
    kv: dict[str, Any] | None
    fusion: list[float] | None

    def frame(self, stream: int) -> Generate:
        return leg_frame(
            stream,
            self.request_id,
            self.prompt,
            self.sampling,
            self.generated,
            self.kv,
            self.fusion,
        )


@dataclass(frozen=True, slots=True)
class SendRelease:
    """Send a Release for ``migration`` on the current leg."""

    migration: str


@dataclass(frozen=True, slots=True)
class CloseLeg:
    """Close the current leg; ``abort``: the worker is told to drop the request."""

    abort: bool


@dataclass(frozen=True, slots=True)
class ListCandidates:
    """Answer with :class:`Candidates`."""


@dataclass(frozen=True, slots=True)
class Deliver:
    """Relay a batch to the client (one with a finish reason ends the stream)."""

    batch: TokenBatch


@dataclass(frozen=True, slots=True)
class Emit:
    """An event on ``star:events`` about this request."""

    kind: EventKind
    detail: str
    instance: str
    migration: str
    data: dict[str, Any]


@dataclass(frozen=True, slots=True)
class Warn:
    """Something for the log; the run goes on."""

    text: str
    data: dict[str, Any]


@dataclass(frozen=True, slots=True)
class Fail:
    """The request cannot go on: the client gets ``error`` (then the driver sends Ended)."""

    error: BackendError


Action = OpenLeg | SendRelease | CloseLeg | ListCandidates | Deliver | Emit | Warn | Fail


@dataclass(frozen=True, slots=True)
class _Pending:
    decision: Decision
    address: str
    since: float


class _Opening(enum.Enum):
    FIRST = "first"
    TARGET = "target"
    RECOVERY = "recovery"


_ANSWERS: dict[type, tuple[type, ...]] = {
    OpenLeg: (Opened, OpenFailed),
    ListCandidates: (Candidates,),
}
_REPLIES = (Start, Opened, OpenFailed, Candidates)


class RunMachine:
    """One request's decode run: :meth:`handle` takes an input and returns the actions.

    The driver performs the actions in order; an :class:`OpenLeg` is answered
    with :class:`Opened` or :class:`OpenFailed` and a :class:`ListCandidates`
    with :class:`Candidates` before any other input. The first input is
    :class:`Start`; :class:`Ended` may come at any time and ends the run.
    """

    def __init__(
        self,
        request_id: str,
        prompt: list[int],
        sampling: dict[str, Any],
        blocker: str | None,
        release_timeout_s: float = RELEASE_TIMEOUT_S,
    ) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.sampling = sampling
        self.blocker = blocker
        self.release_timeout_s = release_timeout_s
        self.state = RunState.DECODING
        self.generated: list[int] = []  # every token delivered, in order
        self.instance = ""  # the current leg's ("" while none is open)
        self.address = ""
        self.where = ""  # the instance of the latest leg (kept after it closes)
        self.migration = ""  # the latest decision started
        self.migrations = 0
        self.recoveries = 0
        self.last_token_s = 0.0
        self.handoff_s = 0.0
        self.fusion: list[float] | None = None  # the predictor state of the last handoff
        self.source: tuple[str, str] | None = None  # (instance, address) of the last source
        self.pending: _Pending | None = None
        self._awaiting: tuple[type, ...] | None = (Start,)
        self._opening: tuple[_Opening, str, str] | None = None  # (why, instance, address)
        self._recovery: tuple[tuple[str, str] | None, set[str]] | None = None  # prefer, exclude
        self._candidates: list[tuple[str, str]] = []
        # A lost source's own (instance, address): tried after every other candidate.
        self._last_resort: tuple[str, str] | None = None
        # Prompt logprobs a leg sent, until the batch that delivers them.
        self.prompt_scores: PromptLogprobs | None = None

    def refuses(self, decision: Decision, address: str | None) -> Emit | None:
        """The ``refused`` event if this run cannot start ``decision`` now (None: it can).

        Asked when the decision arrives (:meth:`proxy.decode_run.DecodeRun.migrate`,
        which queues it only if None) and again when it is handled (:class:`Decided`):
        the run may have moved on in between.
        """
        return refused(self, decision, False, address)

    def deadline(self) -> float | None:
        """When the release under way times out (None: none is)."""
        if self.state is RunState.RELEASING and self.pending is not None:
            return self.pending.since + self.release_timeout_s
        return None

    def handle(self, event: Input) -> list[Action]:
        """The actions for ``event``; :class:`IllegalTransition` if it cannot happen now."""
        if isinstance(event, Ended):
            return self._ended()
        if self.state is RunState.DONE:
            raise IllegalTransition(f"decode run input {type(event).__name__} after it ended")
        if self._awaiting is not None and not isinstance(event, self._awaiting):
            raise IllegalTransition(
                f"decode run input {type(event).__name__} while waiting for "
                f"{' or '.join(t.__name__ for t in self._awaiting)}"
            )
        if self._awaiting is None and isinstance(event, _REPLIES):
            raise IllegalTransition(
                f"decode run input {type(event).__name__} that was not asked for"
            )
        self._awaiting = None
        out: list[Action] = []
        if isinstance(event, Start):
            self._open(out, _Opening.FIRST, event.instance, event.address, event.kv)
        elif isinstance(event, Decided):
            self._decided(out, event)
        elif isinstance(event, Received):
            if isinstance(event.msg, Tokens):
                self._tokens(out, event.msg, event.now)
            elif isinstance(event.msg, Handoff):
                self._handoff(out, event.msg, event.now)
            elif isinstance(event.msg, PromptLogprobs):
                # Before the leg's first tokens (a decode instance prefilling the
                # request itself): they go out with the next batch.
                self.prompt_scores = event.msg
            else:
                self._error(out, event.msg)
        elif isinstance(event, Lost):
            if self.state is RunState.RESUMING:
                self._target_lost(out, event.why)
            else:
                self._source_lost(out, event.why, RunEvent.SOURCE_LOST)
        elif isinstance(event, TimedOut):
            self._source_lost(
                out, "no handoff within the release timeout", RunEvent.RELEASE_TIMEOUT
            )
        elif isinstance(event, Opened | OpenFailed):
            self._opened(out, event)
        elif isinstance(event, Candidates):
            self._candidates = list(event.members)
            self._try_next(out)
        for action in out:
            if type(action) in _ANSWERS:
                self._awaiting = _ANSWERS[type(action)]
        return out

    # -- transitions ------------------------------------------------------------------

    def _fire(self, event: RunEvent) -> None:
        self.state = next_state(self.state, event)

    def _emit(self, kind: EventKind, detail: str = "", instance: str = "", **data: Any) -> Emit:
        return Emit(kind, detail, instance or self.instance, self.migration, data)

    def _decided(self, out: list[Action], cmd: Decided) -> None:
        no = self.refuses(cmd.decision, cmd.address)
        if no is not None:  # e.g. queued while decoding, behind another decision
            out.append(no)
            return
        assert cmd.address is not None
        self._fire(RunEvent.MIGRATE)
        self.pending = _Pending(cmd.decision, cmd.address, cmd.since)
        self.migration = cmd.decision.id
        out.append(
            self._emit(
                EventKind.MIGRATING,
                "release sent",
                target=cmd.decision.target,
                origin=cmd.decision.origin,
                reason=cmd.decision.reason,
            )
        )
        out.append(SendRelease(cmd.decision.id))

    def _tokens(self, out: list[Action], msg: Tokens, now: float) -> None:
        if self.state is RunState.RESUMING and (msg.token_ids or msg.finish_reason):
            self._resumed(out, now)  # the first token (or the end) from the new leg
        else:
            self._fire(RunEvent.TOKENS)
        if msg.token_ids:
            self.generated.extend(msg.token_ids)
            self.last_token_s = now
        if msg.finish_reason is None:
            if msg.token_ids:
                out.append(Deliver(self._with_prompt(_batch(msg))))
            return
        if self.state is RunState.RELEASING:
            self._refused(out, "finished")
        instance = self.instance
        self._fire(RunEvent.FINISH)
        self._close(out, abort=False)
        reason = _FINISH_REASONS.get(msg.finish_reason)
        if reason is None:
            # vLLM's "error" (e.g. a KV load that failed with no recompute): the
            # client gets an error event, not a silently truncated "stop".
            out.append(
                Fail(
                    BackendError(
                        f"decode instance {instance} ended the request "
                        f"with finish reason {msg.finish_reason!r}",
                        code=ErrorCode.ENGINE_ERROR,
                    )
                )
            )
            return
        out.append(Deliver(self._with_prompt(_batch(msg, reason, msg.stop_reason))))

    def _with_prompt(self, batch: TokenBatch) -> TokenBatch:
        """``batch`` with the prompt logprobs a leg sent before it (once per run)."""
        if self.prompt_scores is not None:
            batch.prompt, self.prompt_scores = self.prompt_scores, None
        return batch

    def _refused(self, out: list[Action], reason: str) -> None:
        target = self.pending.decision.target if self.pending else ""
        self.pending = None
        self._fire(RunEvent.REFUSED)
        out.append(self._emit(EventKind.REFUSED, reason, target=target))

    def _handoff(self, out: list[Action], msg: Handoff, now: float) -> None:
        self._fire(RunEvent.HANDOFF)
        assert self.pending is not None  # RELEASING has one
        cmd = self.pending
        expected = len(self.prompt) + len(self.generated)
        if msg.num_tokens != expected:
            out.append(
                Warn(
                    "handoff_token_count_mismatch",
                    {"handoff": msg.num_tokens, "seen": expected},
                )
            )
        self.handoff_s = now
        kv = dict(msg.kv_transfer_params)
        self.fusion = msg.fusion  # the predictor state goes on with every later leg
        out.append(
            self._emit(
                EventKind.RELEASED,
                "handoff",
                target=cmd.decision.target,
                tokens=msg.num_tokens,
                kv_tokens=int(kv.get("remote_num_tokens") or 0),
                release_ms=round((self.handoff_s - cmd.since) * 1000, 2),
                predictor_state=msg.fusion is not None,
            )
        )
        self.source = (self.instance, self.address)
        self._close(out, abort=False)
        self._open(out, _Opening.TARGET, cmd.decision.target, cmd.address, kv)

    def _error(self, out: list[Action], msg: Error) -> None:
        if msg.code in RELEASE_REFUSALS:
            self._refused(out, msg.message)
        elif self.state is RunState.RESUMING:
            self._target_lost(out, f"{msg.code}: {msg.message}")
        else:
            out.append(Fail(error_from(msg, self.instance)))

    def _resumed(self, out: list[Action], now: float) -> None:
        self._fire(RunEvent.RESUMED)
        if self.pending is not None:
            self.migrations += 1
            out.append(
                self._emit(
                    EventKind.RESUMED,
                    "",
                    source=self.pending.decision.source,
                    stall_ms=round((now - self.last_token_s) * 1000, 3),
                    pull_ms=round((now - self.handoff_s) * 1000, 3) if self.handoff_s else None,
                )
            )
        self.pending = None

    def _source_lost(self, out: list[Action], why: str, event: RunEvent) -> None:
        """ABORTED_SRC (or a plain loss of the decode instance): recompute elsewhere.

        A lost connection is not always a dead instance: a worker that found this
        proxy silent (its loop starved past ``cluster.liveness_timeout_s``) drops
        the connection and is still up. So after a plain loss the source itself
        is the last candidate, tried once every other one failed (a dead one
        refuses the connect at once); after a release timeout it is not.
        """
        source = (self.instance, self.address)
        prefer = (self.pending.decision.target, self.pending.address) if self.pending else None
        self._fire(event)
        out.append(self._emit(EventKind.ABORTED, "src", reason=why))
        self._close(out, abort=True)
        last = source if event is RunEvent.SOURCE_LOST and source[1] else None
        self._recover(out, {source[0]}, prefer, last)

    def _target_lost(self, out: list[Action], why: str, dead: str = "") -> None:
        """ABORTED_DST: the target failed before its first token; recompute on the source or any."""
        dead = dead or self.instance
        self._fire(RunEvent.TARGET_LOST)
        out.append(self._emit(EventKind.ABORTED, "dst", instance=dead, reason=why))
        self._close(out, abort=True)
        self._recover(out, {dead}, self.source)

    def _recover(
        self,
        out: list[Action],
        exclude: set[str],
        prefer: tuple[str, str] | None,
        last: tuple[str, str] | None = None,
    ) -> None:
        """Continue by recompute of prompt + generated tokens on a live decode instance
        (``prefer`` first, ``last`` once no other one could)."""
        self.recoveries += 1
        if self.recoveries > MAX_RECOVERIES or self.blocker is not None:
            out.append(
                Fail(
                    BackendError(
                        f"request {self.request_id} lost its decode instance and cannot continue"
                    )
                )
            )
            return
        self._recovery = (prefer, exclude)
        self._last_resort = last
        out.append(ListCandidates())

    def _try_next(self, out: list[Action]) -> None:
        assert self._recovery is not None
        prefer, exclude = self._recovery
        if prefer is not None:
            self._candidates.insert(0, prefer)
            self._recovery = (None, exclude)
        while self._candidates:
            instance, address = self._candidates.pop(0)
            if instance not in exclude:
                self._open(out, _Opening.RECOVERY, instance, address, None)
                return
        if self._last_resort is not None:
            instance, address = self._last_resort
            self._last_resort = None
            self._open(out, _Opening.RECOVERY, instance, address, None)
            return
        self._recovery = None
        out.append(
            Fail(BackendError(f"no live decode instance can continue request {self.request_id}"))
        )

    def _open(
        self,
        out: list[Action],
        why: _Opening,
        instance: str,
        address: str,
        kv: dict[str, Any] | None,
    ) -> None:
        self._opening = (why, instance, address)
        out.append(
            OpenLeg(
                instance,
                address,
                self.request_id,
                self.prompt,
                self.sampling,
                list(self.generated),
                kv,
                self.fusion,
            )
        )

    def _opened(self, out: list[Action], event: Opened | OpenFailed) -> None:
        assert self._opening is not None
        why, instance, address = self._opening
        self._opening = None
        if isinstance(event, Opened):
            self.instance, self.address, self.where = instance, address, instance
            if why is _Opening.RECOVERY:
                self._recovery = None
                self._fire(RunEvent.RECOVERED)
                out.append(
                    self._emit(
                        EventKind.DISPATCHED,
                        "recompute",
                        instance=instance,
                        tokens=len(self.generated),
                    )
                )
            return
        if why is _Opening.FIRST:
            # Nothing reached the client yet: another live decode instance starts it
            # (a recompute of the prompt there). The first leg fails to open when
            # its instance died after the pick saw it up (its connection not yet
            # seen closed): the chaos suite's decode kill.
            self._fire(RunEvent.SOURCE_LOST)
            out.append(
                self._emit(
                    EventKind.ABORTED, "src", instance=instance, reason=f"unreachable: {event.why}"
                )
            )
            self._recover(out, {instance}, None)
        elif why is _Opening.TARGET:
            self._target_lost(out, f"target unreachable: {event.why}", dead=instance)
        else:
            assert self._recovery is not None
            self._recovery[1].add(instance)
            self._try_next(out)

    def _close(self, out: list[Action], abort: bool) -> None:
        if self.instance:
            out.append(CloseLeg(abort))
        self.instance = self.address = ""

    def _ended(self) -> list[Action]:
        if self.state is RunState.DONE:
            return []  # ended already (finished, then closed)
        out: list[Action] = []
        migrating = self.state is RunState.RELEASING or self.state is RunState.RESUMING
        self._fire(RunEvent.FINISH)
        self._awaiting = self._opening = self._recovery = None
        self._close(out, abort=True)
        if migrating:
            out.append(
                self._emit(
                    EventKind.ABORTED, "client", reason="the request ended during the migration"
                )
            )
        return out
