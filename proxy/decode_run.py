"""The driver of :mod:`proxy.migration`'s decode run over the token protocol, and decisions.

:class:`DecodeRun` relays one request's tokens across legs on decode
instances; :class:`Migrator` and :func:`follow_decisions` read
``star:decisions`` in order and hand each to its run.
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import structlog

from proxy.backend import BackendError, GenerationRequest, TokenBatch, error_from
from proxy.migration import (
    MAX_RECOVERIES,
    RELEASE_TIMEOUT_S,
    RunEvent,
    RunState,
    leg_frame,
    next_state,
    refusal,
)
from proxy.upstream import ConnectionLost, Stream, WorkerClient
from star.bus import Bus, Subscriber
from star.wire import Abort, Decision, Error, Event, EventKind, Handoff, Release, Tokens

log = structlog.get_logger(__name__)


@dataclass(slots=True)
class _Migrate:
    """The command a decision becomes, queued on the run's current stream."""

    decision: Decision
    address: str
    since: float = field(default_factory=time.monotonic)


@dataclass(slots=True)
class _Leg:
    instance: str
    address: str
    client: WorkerClient
    stream: Stream


class DecodeRun:
    """One request's decode across instances (see the module docstring)."""

    def __init__(
        self, owner: Any, req: GenerationRequest, sampling: dict[str, Any], blocker: str | None
    ) -> None:
        self.owner = owner  # the ClusterBackend: pool, directory, events
        self.req = req
        self.sampling = sampling
        self.blocker = blocker
        self.state = RunState.DECODING
        self.generated: list[int] = []
        self.leg: _Leg | None = None
        self.pending: _Migrate | None = None
        self.migration = ""
        self.migrations = 0
        self.recoveries = 0
        self.last_token_s = 0.0
        self.handoff_s = 0.0
        self.fusion: list[float] | None = None  # the predictor state of the last handoff
        self.where = ""  # the instance of the latest leg (kept after it closes)
        self.source: tuple[str, str] | None = None  # (instance, address) of the last source

    @property
    def instance(self) -> str:
        return self.leg.instance if self.leg else ""

    def fire(self, event: RunEvent) -> None:
        self.state = next_state(self.state, event)

    def emit(self, kind: EventKind, detail: str = "", instance: str = "", **data: Any) -> None:
        self.owner.emit_event(
            Event(
                kind,
                time.time(),
                self.owner.origin,
                request=self.req.request_id,
                migration=self.migration,
                instance=instance or self.instance,
                detail=detail,
                data=data,
            )
        )

    def migrate(self, decision: Decision, address: str) -> None:
        """Queue a decision on the current stream (accepted by :func:`refusal` first)."""
        assert self.leg is not None
        self.leg.stream.put(_Migrate(decision, address))  # type: ignore[arg-type]

    # -- legs -----------------------------------------------------------------------

    async def _open(self, instance: str, address: str, kv: dict[str, Any] | None) -> None:
        client = await self.owner.pool.get(address)
        stream = client.open()
        self.leg = _Leg(instance, address, client, stream)
        self.where = instance
        self.owner.owned[self.req.request_id] = instance
        await client.send(
            leg_frame(
                stream.id,
                self.req.request_id,
                self.req.prompt_token_ids,
                self.sampling,
                self.generated,
                kv,
                self.fusion,
            )
        )

    async def _close_leg(self, abort: bool) -> None:
        leg, self.leg = self.leg, None
        if leg is None:
            return
        leg.stream.close()
        if abort:
            try:
                await leg.client.send(Abort(leg.stream.id))
            except ConnectionLost:
                pass

    async def start(self, instance: str, address: str, kv: dict[str, Any] | None) -> None:
        await self._open(instance, address, kv)

    async def _recover(self, exclude: set[str], prefer: tuple[str, str] | None) -> None:
        """Continue by recompute of prompt + generated tokens on a live decode instance."""
        self.recoveries += 1
        if self.recoveries > MAX_RECOVERIES or self.blocker is not None:
            raise BackendError(
                f"request {self.req.request_id} lost its decode instance and cannot continue"
            )
        candidates: list[tuple[str, str]] = [prefer] if prefer else []
        candidates += [(m.instance, m.address) for m in self.owner.directory.members("decode")]
        for instance, address in candidates:
            if instance in exclude:
                continue
            try:
                await self._open(instance, address, None)
            except (OSError, ConnectionLost, TimeoutError) as exc:
                exclude.add(instance)
                self.owner.directory.mark_down(address)
                log.warning("recovery target unreachable", instance=instance, error=str(exc))
                continue
            self.fire(RunEvent.RECOVERED)
            self.emit(
                EventKind.DISPATCHED, "recompute", instance=instance, tokens=len(self.generated)
            )
            return
        raise BackendError(f"no live decode instance can continue request {self.req.request_id}")

    # -- the loop -------------------------------------------------------------------

    async def run(self) -> AsyncIterator[TokenBatch]:
        """Relay tokens until the request finishes; migrations happen inside."""
        try:
            while True:
                assert self.leg is not None
                leg = self.leg
                timeout = None
                if self.state is RunState.RELEASING and self.pending is not None:
                    timeout = max(RELEASE_TIMEOUT_S - (time.monotonic() - self.pending.since), 0.0)
                try:
                    if timeout is not None and timeout <= 0:
                        # The deadline passed while the last frame was handled:
                        # time out without reading, as wait_for did
                        # (asyncio.timeout(0) would still take a queued frame).
                        raise TimeoutError
                    # Not wait_for: on Python 3.11 it returns the frame when a
                    # cancel lands just as the frame arrives (gh-86296), and
                    # this loop would go on for a client that is gone.
                    async with asyncio.timeout(timeout):
                        msg = await leg.stream.next()
                except TimeoutError:
                    await self._source_lost("no handoff within the release timeout")
                    continue
                except ConnectionLost as exc:
                    if self.state is RunState.RESUMING:
                        await self._target_lost(str(exc))
                    else:
                        await self._source_lost(str(exc))
                    continue
                if isinstance(msg, _Migrate):
                    await self._on_migrate(msg)
                elif isinstance(msg, Handoff):
                    await self._on_handoff(msg)
                elif isinstance(msg, Error):
                    if msg.code == "not_releasable" or msg.code == "unsupported":
                        self._on_refused(msg.message)
                    elif self.state is RunState.RESUMING:
                        await self._target_lost(f"{msg.code}: {msg.message}")
                    else:
                        raise error_from(msg, leg.instance)
                elif isinstance(msg, Tokens):
                    if self.state is RunState.RESUMING and (msg.token_ids or msg.finish_reason):
                        self._on_resumed()
                    if msg.token_ids:
                        self.generated.extend(msg.token_ids)
                        self.last_token_s = time.monotonic()
                    if msg.finish_reason is not None:
                        if self.state is RunState.RELEASING:
                            self._on_refused("finished")
                        self.fire(RunEvent.FINISH)
                        await self._close_leg(abort=False)
                        reason = msg.finish_reason
                        if reason not in ("stop", "length", "abort"):
                            # vLLM's "error" (e.g. a KV load that failed with no
                            # recompute): the client gets an error event, not a
                            # silently truncated "stop".
                            raise BackendError(
                                f"decode instance {leg.instance} ended the request "
                                f"with finish reason {reason!r}",
                                code="engine_error",
                            )
                        yield TokenBatch(list(msg.token_ids), reason, msg.stop_reason)  # type: ignore[arg-type]
                        return
                    if msg.token_ids:
                        yield TokenBatch(list(msg.token_ids))
        finally:
            if self.leg is not None:
                await self._close_leg(abort=True)
            if self.state is RunState.RELEASING or self.state is RunState.RESUMING:
                self.emit(
                    EventKind.ABORTED, "client", reason="the request ended during the migration"
                )
            self.state = RunState.DONE

    async def _on_migrate(self, cmd: _Migrate) -> None:
        if self.state is not RunState.DECODING or self.leg is None:
            self.emit(EventKind.REFUSED, "already migrating", target=cmd.decision.target)
            return
        self.pending = cmd
        self.migration = cmd.decision.id
        self.fire(RunEvent.MIGRATE)
        self.emit(
            EventKind.MIGRATING,
            "release sent",
            target=cmd.decision.target,
            origin=cmd.decision.origin,
            reason=cmd.decision.reason,
        )
        await self.leg.client.send(Release(self.leg.stream.id, cmd.decision.id))

    def _on_refused(self, reason: str) -> None:
        target = self.pending.decision.target if self.pending else ""
        self.pending = None
        self.fire(RunEvent.REFUSED)
        self.emit(EventKind.REFUSED, reason, target=target)

    async def _on_handoff(self, msg: Handoff) -> None:
        assert self.pending is not None and self.leg is not None
        cmd, source = self.pending, self.leg
        expected = len(self.req.prompt_token_ids) + len(self.generated)
        if msg.num_tokens != expected:
            log.warning(
                "handoff token count differs from what the client saw",
                handoff=msg.num_tokens,
                seen=expected,
            )
        self.fire(RunEvent.HANDOFF)
        self.handoff_s = time.monotonic()
        kv = dict(msg.kv_transfer_params)
        self.fusion = msg.fusion  # the predictor state goes on with every later leg
        self.emit(
            EventKind.RELEASED,
            "handoff",
            target=cmd.decision.target,
            tokens=msg.num_tokens,
            kv_tokens=int(kv.get("remote_num_tokens") or 0),
            release_ms=round((self.handoff_s - cmd.since) * 1000, 2),
            predictor_state=msg.fusion is not None,
        )
        await self._close_leg(abort=False)
        self.source = (source.instance, source.address)
        try:
            await self._open(cmd.decision.target, cmd.address, kv)
        except (OSError, ConnectionLost, TimeoutError) as exc:
            self.owner.directory.mark_down(cmd.address)
            await self._target_lost(f"target unreachable: {exc}")

    def _on_resumed(self) -> None:
        self.fire(RunEvent.RESUMED)
        now = time.monotonic()
        if self.pending is not None:
            self.migrations += 1
            self.emit(
                EventKind.RESUMED,
                "",
                source=self.pending.decision.source,
                stall_ms=round((now - self.last_token_s) * 1000, 3),
                pull_ms=round((now - self.handoff_s) * 1000, 3) if self.handoff_s else None,
            )
        self.pending = None

    async def _source_lost(self, why: str) -> None:
        """ABORTED_SRC (or a plain loss of the decode instance): recompute elsewhere."""
        source = self.leg.instance if self.leg else ""
        target = self.pending.decision.target if self.pending else None
        address = self.pending.address if self.pending else None
        self.fire(RunEvent.SOURCE_LOST)
        self.emit(EventKind.ABORTED, "src", reason=why)
        await self._close_leg(abort=True)
        await self._recover({source}, (target, address) if target and address else None)

    async def _target_lost(self, why: str, source: tuple[str, str] | None = None) -> None:
        """ABORTED_DST: the target failed before its first token; recompute on the source or any."""
        dead = (
            self.leg.instance
            if self.leg
            else (self.pending.decision.target if self.pending else "")
        )
        self.fire(RunEvent.TARGET_LOST)
        self.emit(EventKind.ABORTED, "dst", instance=dead, reason=why)
        await self._close_leg(abort=True)
        await self._recover({dead}, source or self.source)


class Migrator:
    """Turns decisions into migrations of this proxy's requests (:func:`follow_decisions`)."""

    def __init__(
        self,
        runs: dict[str, DecodeRun],
        address_of: Callable[[str], str | None],
        emit: Callable[[Event], None],
        origin: str,
    ) -> None:
        self.runs = runs
        self.address_of = address_of
        self.emit = emit
        self.origin = origin
        self.finished: collections.OrderedDict[str, None] = collections.OrderedDict()

    def finished_request(self, request_id: str) -> None:
        self.finished[request_id] = None
        while len(self.finished) > 10_000:
            self.finished.popitem(last=False)

    def apply(self, decision: Decision) -> str | None:
        """Start ``decision`` or say why not (also as a ``refused`` event)."""
        run = self.runs.get(decision.request)
        reason = refusal(run, decision, decision.request in self.finished)
        address = self.address_of(decision.target) if reason is None else None
        if reason is None and address is None:
            reason = f"target {decision.target} is not a live decode instance"
        if reason is not None:
            self.emit(
                Event(
                    EventKind.REFUSED,
                    time.time(),
                    self.origin,
                    request=decision.request,
                    migration=decision.id,
                    instance=run.instance if run else decision.source,
                    detail=reason,
                    data={"target": decision.target},
                )
            )
            return reason
        assert run is not None and address is not None
        run.migrate(decision, address)
        return None


async def follow_decisions(bus: Bus, migrator: Migrator, start: str = "$") -> None:
    """Read ``star:decisions`` in order and apply each (runs until cancelled)."""
    # Through a Redis outage the iteration waits (and logs it once): streams go
    # on without migrations until Redis is back, then reading resumes after the
    # last decision seen.
    async for entry in Subscriber(bus, "decisions", Decision, start=start):
        decision = entry.msg
        assert isinstance(decision, Decision)
        try:
            migrator.apply(decision)
        except Exception:  # a bug here must not stop the following of decisions
            log.exception("decision failed", decision=decision.id, request=decision.request)
