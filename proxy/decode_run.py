"""The decode run's driver: :mod:`proxy.migration`'s machine over the token protocol.

:class:`DecodeRun` relays one request's tokens from its current leg (a stream
on a decode worker) and performs what :class:`~proxy.migration.RunMachine`
asks: open a leg, send a Release, close a leg, emit an event. It reaches its
owner only through :class:`Fleet` and its legs only through :class:`Leg`, so
it runs as well over in-process fakes as over workers. Decisions come on
their own channel (:meth:`DecodeRun.migrate`); :class:`Migrator` and
:func:`follow_decisions` read ``star:decisions`` in order and hand each to its
run.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, Protocol

import structlog

from proxy.backend import GenerationRequest, TokenBatch
from proxy.migration import (
    RELEASE_TIMEOUT_S,
    Candidates,
    CloseLeg,
    Decided,
    Deliver,
    Emit,
    Ended,
    Input,
    ListCandidates,
    Lost,
    Opened,
    OpenFailed,
    OpenLeg,
    Received,
    RunMachine,
    RunState,
    SendRelease,
    Start,
    TimedOut,
    Warn,
    refused,
)
from proxy.stream_context import with_prompt_logprobs
from proxy.upstream import ConnectionLost, Stream
from star.aio import deadline
from star.bus import Bus, Subscriber
from star.decisions import DecisionGate, report_drop
from star.wire import (
    Abort,
    Attached,
    Decision,
    Error,
    Event,
    Generate,
    Handoff,
    LogprobTokens,
    Message,
    PromptLogprobs,
    Release,
    ResumableGenerate,
    Tokens,
)

log = structlog.get_logger(__name__)


class Leg(Protocol):
    """One request's stream on a decode worker (:class:`proxy.upstream.Stream`)."""

    @property
    def id(self) -> int: ...

    async def next(self) -> Message:
        """The next frame; raises :class:`~proxy.upstream.ConnectionLost`."""
        ...

    async def send(self, msg: Message) -> None:
        """Send a frame; raises :class:`~proxy.upstream.ConnectionLost`."""
        ...

    def close(self) -> None: ...


@dataclass(slots=True)
class Found:
    """A request a worker handed over (:func:`proxy.adopt.attach`): its answer
    and the stream it runs on now."""

    attached: Attached
    instance: str
    address: str
    leg: Stream


class Fleet(Protocol):
    """What a run needs of its owner (:class:`proxy.cluster.ClusterBackend`)."""

    @property
    def origin(self) -> str: ...

    async def open_leg(self, address: str) -> Leg:
        """A new stream on the worker at ``address``; raises OSError,
        TimeoutError or ConnectionLost when it cannot be reached."""
        ...

    def decode_members(self) -> list[tuple[str, str]]:
        """The live decode instances as (instance, address), for a recovery."""
        ...

    def mark_down(self, address: str) -> None:
        """``address`` refused a connection: avoid it for a while."""
        ...

    def emit_event(self, event: Event) -> None: ...

    @property
    def handing_off(self) -> bool:
        """The proxy is stopping: a resumable request's worker holds it for another proxy."""
        ...

    async def rejoin(self, instance: str, address: str, request_id: str) -> Found | None:
        """``request_id`` attached again on ``address``, which still holds it, or None."""
        ...


class DecodeRun:
    """One request's decode across instances (the machine: :mod:`proxy.migration`)."""

    def __init__(
        self,
        fleet: Fleet,
        req: GenerationRequest,
        sampling: dict[str, Any],
        blocker: str | None,
        release_timeout_s: float = RELEASE_TIMEOUT_S,
    ) -> None:
        self.fleet = fleet
        self.req = req
        self.machine = RunMachine(
            req.request_id, req.prompt_token_ids, sampling, blocker, release_timeout_s
        )
        self.leg: Leg | None = None
        # Decisions accepted while the current leg runs (they go with it).
        self.decisions: asyncio.Queue[Decided] = asyncio.Queue()
        self._waiting: asyncio.Timeout | None = None  # the wait for a frame, while it lasts

    # -- what the owner and the Migrator read -----------------------------------------

    @property
    def state(self) -> RunState:
        return self.machine.state

    @property
    def instance(self) -> str:
        """The current leg's decode instance ("" while none is open)."""
        return self.machine.instance

    @property
    def blocker(self) -> str | None:
        return self.machine.blocker

    @property
    def where(self) -> str:
        """The latest leg's instance (kept after it closed)."""
        return self.machine.where

    @property
    def generated(self) -> list[int]:
        return self.machine.generated

    @property
    def migrations(self) -> int:
        return self.machine.migrations

    @property
    def recoveries(self) -> int:
        return self.machine.recoveries

    def migrate(self, decision: Decision, address: str | None) -> str | None:
        """Queue ``decision`` (``address``: the target's, None if not live), or refuse it.

        The machine decides (:meth:`~proxy.migration.RunMachine.refuses`); a
        refusal is emitted and its reason returned (None: queued).
        """
        no = self.machine.refuses(decision, address)
        if no is not None:
            self._emit(no)
            return no.detail
        self.decisions.put_nowait(Decided(decision, address, time.monotonic()))
        waiting = self._waiting
        if waiting is not None and not waiting.expired():
            waiting.reschedule(asyncio.get_running_loop().time())  # stop waiting for a frame
        return None

    # -- the loop ---------------------------------------------------------------------

    async def start(self, instance: str, address: str, kv: dict[str, Any] | None) -> None:
        """Open the first leg, or (it fails to open) a recovery's on another instance.

        Tokens already in :attr:`generated` (a request taken over from another
        proxy) make it a continuation after them.
        """
        [first] = self.machine.handle(Start(instance, address, kv))
        assert isinstance(first, OpenLeg)
        try:
            await self._open(first)
        except (OSError, ConnectionLost, TimeoutError) as exc:
            # The instance died after the pick: start it on another one (recompute),
            # or fail with the machine's BackendError when none is left.
            self.fleet.mark_down(address)
            log.warning("decode_instance_unreachable", instance=instance, error=str(exc))
            batches = await self._perform(OpenFailed(str(exc)))
            assert not batches  # a recovery's leg only opens: no tokens yet
        else:
            self.machine.handle(Opened())

    def adopt(self, instance: str, address: str, leg: Leg, generated: list[int]) -> None:
        """Run on from ``leg``: a stream on ``instance`` this proxy attached (star.wire.Attach),
        after the ``generated`` tokens the worker reported."""
        self.machine.generated.extend(generated)
        [first] = self.machine.handle(Start(instance, address, None))
        assert isinstance(first, OpenLeg)  # already open: the Attach took the stream over
        self.leg = leg
        self.machine.handle(Opened())

    async def run(self) -> AsyncIterator[TokenBatch]:
        """Relay tokens until the request finishes; migrations happen inside."""
        try:
            while True:
                for batch in await self._perform(await self._next_input()):
                    yield batch
                    if batch.finish_reason is not None:
                        return
        finally:
            await self._perform(Ended())  # closes a leg still open (the run was cut short)

    async def _next_input(self) -> Input:
        """A decision, the next frame of the current leg, or the release timing out."""
        while True:
            if not self.decisions.empty():
                return self.decisions.get_nowait()
            leg = self.leg
            assert leg is not None
            due = self.machine.deadline()
            delay = None if due is None else due - time.monotonic()
            if delay is not None and delay <= 0:
                return TimedOut()  # without reading, even if a frame is in
            try:
                # The wait for a frame ends at the release deadline, or at once
                # when a decision comes in (migrate() moves it to now).
                async with deadline(delay) as self._waiting:
                    msg = await leg.next()
            except TimeoutError:
                continue  # the loop's top says which
            except ConnectionLost as exc:
                self._waiting = None  # exited: migrate() must not reschedule it meanwhile
                rejoined = await self._rejoin()
                if rejoined is False:
                    return Lost(str(exc))
                if rejoined is True:
                    continue  # the same worker runs it on; nothing new yet
                return rejoined
            finally:
                self._waiting = None
            if isinstance(msg, PromptLogprobs) and self.req.context:
                # computed by this leg (it prefilled the request): the later legs carry them
                context = with_prompt_logprobs(self.req.context, msg)
                self.req = dataclasses.replace(self.req, context=context)
            if isinstance(msg, Tokens | Handoff | Error | PromptLogprobs):
                return Received(msg, time.monotonic())
            # nothing else belongs to a request's stream

    async def _rejoin(self) -> Received | bool:
        """After a plain loss of the leg's connection, a resumable request its
        worker still holds runs on there: the worker dropped this proxy as
        silent (a starved event loop), or this proxy dropped the worker. No
        recompute, and no orphan decoding on there for ``worker.orphan_grace_s``
        beside a recompute elsewhere (which, fleet-wide, starved the fleet
        further). The tokens it generated meanwhile come as one frame
        (True: none yet; False: not held there, recover as usual).
        """
        m = self.machine
        if (
            not self.req.context
            or m.state is not RunState.DECODING
            or m.pending is not None
            or not m.address
        ):
            return False
        found = await self.fleet.rejoin(m.instance, m.address, self.req.request_id)
        if found is None:
            return False
        frame = rejoined_frame(found.attached, m.generated, found.leg.id)
        if frame is None:  # released for a move, or not this run's tokens
            found.leg.close()
            with contextlib.suppress(ConnectionLost):
                await found.leg.send(Abort(found.leg.id))
            return False
        assert self.leg is not None
        self.leg.close()
        self.leg = found.leg
        log.info(
            "stream_rejoined",
            request_id=self.req.request_id,
            instance=m.instance,
            tokens=len(frame.token_ids),
            finished=frame.finish_reason is not None,
        )
        if not frame.token_ids and frame.finish_reason is None:
            return True
        return Received(frame, time.monotonic())

    async def _perform(self, first: Input) -> list[TokenBatch]:
        """Feed ``first`` to the machine and do what it says (answering its questions)."""
        out: list[TokenBatch] = []
        todo = [first]
        while todo:
            for action in self.machine.handle(todo.pop()):
                if isinstance(action, Deliver):
                    out.append(action.batch)
                elif isinstance(action, Emit):
                    self._emit(action)
                elif isinstance(action, SendRelease):
                    assert self.leg is not None
                    await self.leg.send(Release(self.leg.id, action.migration))
                elif isinstance(action, CloseLeg):
                    await self._close_leg(action.abort)
                elif isinstance(action, OpenLeg):
                    try:
                        await self._open(action)
                    except (OSError, ConnectionLost, TimeoutError) as exc:
                        self.fleet.mark_down(action.address)
                        log.warning(
                            "decode_instance_unreachable", instance=action.instance, error=str(exc)
                        )
                        todo.append(OpenFailed(str(exc)))
                    else:
                        todo.append(Opened())
                elif isinstance(action, ListCandidates):
                    todo.append(Candidates(tuple(self.fleet.decode_members())))
                elif isinstance(action, Warn):
                    log.warning(action.text, **action.data)
                else:
                    raise action.error
        return out

    # -- legs -------------------------------------------------------------------------

    async def _open(self, action: OpenLeg) -> None:
        leg = await self.fleet.open_leg(action.address)
        frame = action.frame(leg.id)
        if self.req.context:  # every leg carries it: whichever worker holds the request has it
            frame = resumable(frame, self.req.context)
        try:
            await leg.send(frame)
        except BaseException:
            leg.close()
            with contextlib.suppress(ConnectionLost):
                await leg.send(Abort(leg.id))  # the Generate may have gone out
            raise
        self.leg = leg

    async def _close_leg(self, abort: bool) -> None:
        leg, self.leg = self.leg, None
        if leg is None:
            return
        # Decisions were accepted for this leg: they go with it.
        while not self.decisions.empty():
            self.decisions.get_nowait()
        leg.close()
        if abort and not (self.req.context and self.fleet.handing_off):
            with contextlib.suppress(ConnectionLost):
                await leg.send(Abort(leg.id))
        # else: the proxy is stopping; the worker holds the request for a resume elsewhere

    def _emit(self, action: Emit) -> None:
        self.fleet.emit_event(event(action, self.fleet.origin, self.req.request_id))


def rejoined_frame(done: Attached, have: list[int], stream: int) -> Tokens | None:
    """The frame that brings a run holding ``have`` up to ``done`` (an Attach's
    answer from the worker it ran on): the tokens after ``have``, with their
    logprobs if it asked for some, and the end if it has ended. None when
    ``done`` is not where ``have`` left off (released for a move, other tokens,
    logprobs the worker does not hold)."""
    out = done.output_token_ids
    if done.released or out[: len(have)] != have:
        return None
    gap = out[len(have) :]
    if done.logprobs is None:
        return Tokens(stream, gap, done.finish_reason, done.stop_reason)
    start = len(have) - done.scored_from  # the gap's first position in the scored arrays
    if start < 0:
        return None
    k = done.top_k
    return LogprobTokens(
        stream,
        gap,
        done.finish_reason,
        done.stop_reason,
        logprobs=done.logprobs[start:],
        top_ids=done.top_ids[start * k :],
        top_logprobs=done.top_logprobs[start * k :],
    )


def resumable(frame: Generate, context: bytes) -> ResumableGenerate:
    """``frame`` as a :class:`~star.wire.ResumableGenerate` carrying ``context``."""
    return ResumableGenerate(
        stream=frame.stream,
        request_id=frame.request_id,
        prompt_token_ids=frame.prompt_token_ids,
        sampling=frame.sampling,
        kv_transfer_params=frame.kv_transfer_params,
        continued=frame.continued,
        fusion=frame.fusion,
        resume=frame.resume,
        context=context,
    )


def event(action: Emit, origin: str, request: str) -> Event:
    """The bus event of an :class:`~proxy.migration.Emit` about ``request``, said now."""
    return Event.now(
        action.kind,
        origin,
        request=request,
        migration=action.migration,
        instance=action.instance,
        detail=action.detail,
        data=action.data,
    )


class Migrator:
    """Turns decisions into migrations of this proxy's requests (:func:`follow_decisions`)."""

    def __init__(
        self,
        runs: dict[str, DecodeRun],
        address_of: Callable[[str], str | None],
        emit: Callable[[Event], None],
        origin: str,
        running_on: Callable[[str], str | None] = lambda _request: None,
    ) -> None:
        self.runs = runs
        self.address_of = address_of
        self.emit = emit
        self.origin = origin
        # Where a request runs as the workers' latest reports have it: with
        # several proxies, one this proxy runs none of is another proxy's.
        self.running_on = running_on
        self.finished: collections.OrderedDict[str, None] = collections.OrderedDict()

    def finished_request(self, request_id: str) -> None:
        self.finished[request_id] = None
        while len(self.finished) > 10_000:
            self.finished.popitem(last=False)

    def apply(self, decision: Decision) -> str | None:
        """Hand ``decision`` to its run, or refuse it; why not (None: handed on).

        Every refusal is the machine's (:func:`~proxy.migration.refused`), as a
        ``refused`` event: the run's own, or for a request this proxy runs none of
        and no worker reports running. A request a worker reports but this proxy
        does not run is another proxy's to move or refuse: nothing is said.
        """
        run = self.runs.get(decision.request)
        if run is not None:
            return run.migrate(decision, self.address_of(decision.target))
        finished = decision.request in self.finished
        elsewhere = None if finished else self.running_on(decision.request)
        if elsewhere is not None:
            log.debug("decision_for_another_proxy", decision=decision.id, instance=elsewhere)
            return f"another proxy's request (on {elsewhere})"
        no = refused(None, decision, finished, None)
        assert no is not None  # there is no run to start it
        self.emit(event(no, self.origin, decision.request))
        return no.detail


async def follow_decisions(
    bus: Bus, migrator: Migrator, max_age_s: float, start: str = "$"
) -> None:
    """Read ``star:decisions`` in order and apply each once (runs until cancelled).

    A decision seen before, older than ``max_age_s`` or from a deposed leader is
    dropped (:class:`star.decisions.DecisionGate`), so a stream read again from
    the start re-applies nothing and refuses nothing.
    """
    # Through a Redis outage the iteration waits (and logs it once): streams go
    # on without migrations until Redis is back, then reading resumes after the
    # last decision seen.
    gate = DecisionGate(max_age_s)
    async for entry in Subscriber(bus, "decisions", Decision, start=start):
        decision = entry.msg
        assert isinstance(decision, Decision)
        why = gate.admit(decision, time.time())
        if why is not None:
            report_drop(log, gate, why, decision)
            continue
        try:
            migrator.apply(decision)
        except Exception:  # a bug here must not stop the following of decisions
            log.exception("decision_failed", decision=decision.id, request=decision.request)
