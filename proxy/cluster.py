"""The proxy's backend: prefill on a prefill worker, then decode on a decode worker.

:class:`Directory` knows the live instances: the scheduler's dispatch view
(``<prefix>:load``) when it is fresh, otherwise the proxy's own view built
from the workers' reports (so serving goes on while no scheduler runs).
:meth:`Directory.pick` applies the P->D dispatch policy (docs/design.md §3) to that
view, corrected by what this proxy dispatched since the view was taken: the
policy the scheduler publishes with its view (``<prefix>:dispatch``, its
``scheduler.dispatch``) while fresh, else the proxy's own ``proxy.dispatch``.
The rule is the simulator's, :func:`star.planner.dispatch.choose_on_view`
(a load-aware pick passes over an instance that cannot hold the request).

:class:`ClusterBackend` implements :class:`proxy.backend.Backend`: for each
request it runs the prompt on a prefill worker (one token, KV held for
NIXL), then opens the decode stream on the chosen decode worker with the
prefill's ``kv_transfer_params`` so the decode worker pulls the KV through
NIXL, and relays the decode worker's tokens. While no prefill instance
answers (none up or reachable, or the chosen one went away during the
prefill), the request runs whole on the chosen decode instance instead,
prefill included (``proxy.prefill_fallback``; off: 503 as before).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import structlog
from prometheus_client.core import CounterMetricFamily, Metric

from proxy import adopt
from proxy.backend import (
    BackendError,
    BackendUnavailable,
    GenerationRequest,
    RequestRejected,
    TokenBatch,
    error_from,
)
from proxy.decode_run import DecodeRun, Found, Migrator
from proxy.stream_context import with_prompt_logprobs
from proxy.upstream import ConnectionLost, Stream, WorkerClient, WorkerPool
from star.bus import Bus, BusUnavailable, Outage, Subscriber
from star.planner.dispatch import OutputMean, booking, choose_on_view
from star.report_gate import SKEW_S, ReportGate, report_refusal
from star.sampling import migration_blocker
from star.settings import dispatch_policy
from star.wire import Abort, Error, Event, EventKind, Generate, PromptLogprobs, Report, Tokens

log = structlog.get_logger(__name__)


@dataclass(frozen=True, slots=True)
class Member:
    """One live instance as the proxy sees it."""

    instance: str
    role: str
    address: str
    tokens: int
    capacity_tokens: int
    workload: float
    running: int

    @classmethod
    def of_report(cls, r: Report) -> Member:
        """The instance as its own report has it (workload: the tokens it holds now)."""
        return cls(
            r.instance,
            r.role,
            r.address,
            r.used_tokens,
            r.capacity_tokens,
            float(r.used_tokens),
            len(r.requests),
        )


class Directory:
    """Live instances from ``<prefix>:load`` (preferred) or ``<prefix>:reports``."""

    def __init__(self, bus: Bus, staleness_s: float, charge: str = "expected") -> None:
        self.bus = bus
        self.staleness_s = staleness_s
        # What a current-load decode dispatch books until the instance's next
        # view (proxy.dispatch_charge; star.planner.dispatch.booking), and the
        # output lengths of the requests this proxy saw finish.
        self.charge = charge
        self.outputs = OutputMean()
        self._reports: dict[str, tuple[float, Report]] = {}
        # Reports from the bus in sequence per incarnation, none older than staleness.
        self.gate = ReportGate(staleness_s + SKEW_S)
        self._running: dict[str, frozenset[str]] = {}  # instance -> request ids it reported
        self._load: dict[str, tuple[float, Member]] = {}
        # Tokens this proxy dispatched to each instance since its view was taken
        # (dropped when its view or report changes).
        self._pending: dict[str, float] = {}
        self._down: dict[str, float] = {}  # address -> until (monotonic)
        self._picks: dict[str, int] = {}  # role -> picks so far (round-robin's position)
        # The scheduler's published dispatch policy, when last read (monotonic).
        self._policy: tuple[float, str] | None = None
        self._bad_policy = ""

    async def follow_reports(self) -> None:
        start = f"{int((time.time() - self.staleness_s) * 1000)}-0"
        # Through a Redis outage the iteration waits (and logs it once): the
        # proxy keeps serving on the last view, reports age out by staleness.
        async for entry in Subscriber(self.bus, "reports", Report, start=start):
            report = entry.msg
            assert isinstance(report, Report)
            self.take_report(report)

    def take_report(self, report: Report, now: float | None = None) -> bool:
        """A report read from the bus: noted if it comes in sequence (star.report_gate);
        a replayed or reordered one moves no address back. Whether it was noted."""
        why = self.gate.admit(report, time.time() if now is None else now)
        if why is not None:
            report_refusal(log, self.gate, why, report)
            return False
        self.note_report(report)
        return True

    def note_report(self, report: Report) -> None:
        """Take a worker's report as its instance's latest."""
        self._reports[report.instance] = (time.monotonic(), report)
        self._running[report.instance] = frozenset(r.id for r in report.requests)
        self._pending.pop(report.instance, None)

    def running_on(self, request_id: str) -> str | None:
        """The instance whose fresh report lists ``request_id`` (None: none does)."""
        now = time.monotonic()
        for instance, ids in self._running.items():
            if request_id in ids and now - self._reports[instance][0] <= self.staleness_s:
                return instance
        return None

    async def poll_load(self, interval_s: float = 0.25) -> None:
        outage = Outage("dispatch_view_unreadable", "dispatch_view_readable_again")
        while True:
            try:
                await self.refresh()
            except BusUnavailable as exc:
                outage.down(exc)
                continue
            outage.up()
            await asyncio.sleep(interval_s)

    async def refresh(self) -> None:
        """Read the scheduler's dispatch view and policy once."""
        view, policy = await self.bus.read_dispatch()
        now, wall = time.monotonic(), time.time()
        self._follow_policy(policy, now)
        for name, e in view.items():
            if wall - e.ts <= self.staleness_s:
                member = Member(
                    e.instance,
                    e.role,
                    e.address,
                    e.tokens,
                    e.capacity_tokens,
                    e.workload,
                    e.running,
                )
                if self._load.get(name, (0.0, None))[1] != member:
                    self._pending.pop(name, None)
                self._load[name] = (now, member)

    def _follow_policy(self, policy: str | None, now: float) -> None:
        if policy is None:
            return  # none published (no scheduler, or its key expired): ages out
        if dispatch_policy(policy) is not None:
            if policy != self._bad_policy:
                log.warning("dispatch_policy_unknown_ignored", policy=policy)
                self._bad_policy = policy
            return
        if self._policy is None or self._policy[1] != policy:
            log.info("dispatch_policy_followed", policy=policy)
        self._policy = (now, policy)

    def policy(self, fallback: str) -> str:
        """The P->D policy to apply: the scheduler's while fresh, else ``fallback`` (proxy.dispatch)."""
        if self._policy is not None and time.monotonic() - self._policy[0] <= self.staleness_s:
            return self._policy[1]
        return fallback

    def members(self, role: str) -> list[Member]:
        now = time.monotonic()
        fresh_load = {n: m for n, (t, m) in self._load.items() if now - t <= self.staleness_s}
        out: dict[str, Member] = {}
        for name, (t, r) in self._reports.items():
            if now - t <= self.staleness_s and not r.draining:  # draining: takes no new streams
                out[name] = Member.of_report(r)
        for name, m in fresh_load.items():
            if name in out or not self._reports:
                out[name] = m  # the scheduler's view (with booked moves) wins
        live = [m for m in out.values() if m.role == role and self._down.get(m.address, 0.0) <= now]
        if live:
            return live
        # Nothing fresh: reports can lag far behind on a starved host or while
        # Redis is unreachable. Instances last heard of that have not refused a
        # connection are still worth trying; a dead one is marked down on the
        # first refused connection, and only then is the answer 503.
        last = [Member.of_report(r) for _t, r in self._reports.values() if not r.draining]
        stale = [m for m in last if m.role == role and self._down.get(m.address, 0.0) <= now]
        if stale:
            log.warning(
                "no_fresh_reports_using_last_known",
                role=role,
                instances=[m.instance for m in stale],
            )
        return stale

    def address(self, role: str, instance: str) -> str | None:
        """Address of ``instance`` as a migration target (None: not a live ``role`` instance).

        The rule of :meth:`members` for one instance: a fresh one, or, when its
        reports lag (a starved host, Redis unreachable), the last known address
        of an instance that has not refused a connection since. A target that
        turns out to be dead costs an ABORTED_DST and a recompute, and is marked
        down on the refused connection.
        """
        for m in self.members(role):
            if m.instance == instance:
                return m.address
        now = time.monotonic()
        known = self._reports.get(instance)
        if (
            known is None
            or known[1].role != role
            or known[1].draining
            or self._down.get(known[1].address, 0.0) > now
        ):
            return None
        log.warning("no_fresh_report_using_last_address", role=role, instance=instance)
        return known[1].address

    def pick(self, role: str, policy: str, tokens: int) -> Member:
        """A ``role`` instance for a request of ``tokens`` by ``policy``: the
        simulator's rule (:func:`choose_on_view`) on :meth:`members` in name order.

        The view is each instance's tokens (``workload`` for ``predicted``) plus
        what this proxy dispatched to it since, and its capacity; round-robin
        counts this role's picks. A ``current-load`` decode pick books
        :func:`booking` (``proxy.dispatch_charge``), any other pick ``tokens``.
        """
        members = sorted(self.members(role), key=lambda m: m.instance)
        if not members:
            raise BackendUnavailable(
                f"no {role} instance is up (no fresh reports on {self.bus.keys.reports})"
            )
        pending = np.array([self._pending.get(m.instance, 0.0) for m in members])
        rr = self._picks.get(role, 0)
        self._picks[role] = rr + 1
        i = choose_on_view(
            policy,
            np.array([m.tokens for m in members], dtype=np.float64) + pending,
            np.array([m.capacity_tokens for m in members], dtype=np.float64),
            tokens,
            rr,
            np.array([m.workload for m in members], dtype=np.float64) + pending,
        )
        member = members[i]
        booked = float(tokens)
        if role == "decode" and policy == "current-load":
            booked = booking(tokens, self.charge, self.outputs.mean)
        self._pending[member.instance] = self._pending.get(member.instance, 0.0) + booked
        return member

    def finished(self, output_tokens: int) -> None:
        """A request ended at its natural length (stop or length): what the
        ``expected`` booking expects of the next ones."""
        self.outputs.add(output_tokens)

    def mark_down(self, address: str, for_s: float = 2.0) -> None:
        """Avoid an instance that refused a connection for a little while."""
        self._down[address] = time.monotonic() + for_s


class ClusterBackend:
    """Prefill then decode over the token protocol; see the module docstring."""

    def __init__(
        self,
        directory: Directory,
        pool: WorkerPool,
        policy: str,  # proxy.dispatch: the decode policy while no scheduler publishes one
        origin: str,
        events: asyncio.Queue[Event] | None = None,
        prefill_fallback: bool = True,  # proxy.prefill_fallback
    ) -> None:
        self.directory = directory
        self.pool = pool
        self.policy = policy
        self.origin = origin
        self.events = events
        self.prefill_fallback = prefill_fallback
        # Requests prefilled on their decode instance because no prefill
        # instance answered (star_proxy_prefill_fallbacks_total), and those of
        # the episode under way (None: none is; it ends at a prefill that works).
        self.prefill_fallbacks = 0
        self._episode: int | None = None
        self.runs: dict[str, DecodeRun] = {}  # request id -> its decode run
        # The proxy is stopping: a resumable run that ends now is left to its
        # worker (no Abort), for its client to resume on another proxy.
        self.handing_off = False
        self.migrator = Migrator(
            self.runs, self.decode_address, self._emit, origin, self.directory.running_on
        )

    def health(self) -> dict[str, Any]:
        prefill = self.directory.members("prefill")
        decode = self.directory.members("decode")
        return {
            # Without a prefill instance the decode instances serve whole requests.
            "ok": bool(decode and (prefill or self.prefill_fallback)),
            "prefill": sorted(m.instance for m in prefill),
            "decode": sorted(m.instance for m in decode),
            "streams": len(self.runs),
        }

    def _emit(self, event: Event) -> None:
        if self.events is not None:
            try:
                self.events.put_nowait(event)
            except asyncio.QueueFull:
                log.warning("event_dropped_queue_full", event=event.event.value)

    async def generate(self, req: GenerationRequest) -> AsyncIterator[TokenBatch]:
        if req.n != 1:
            raise RequestRejected("n > 1 reaches a backend fanned out (proxy.fanout), never as one")
        sampling = dict(req.sampling)
        sampling.pop("n", None)
        kv_params, prompt = await self._prefill_or_local(req, sampling)
        if prompt is not None and req.context:  # for a proxy that takes the stream over
            req = dataclasses.replace(req, context=with_prompt_logprobs(req.context, prompt))
        async for batch in self._decode(req, sampling, kv_params):
            if prompt is not None and batch.prompt is None:
                # The prefill's prompt logprobs go out with the first batch.
                batch.prompt, prompt = prompt, None
            yield batch

    def collect(self) -> Iterator[Metric]:
        """Prometheus custom-collector hook (registered beside the app's metrics)."""
        yield CounterMetricFamily(
            "star_proxy_prefill_fallbacks",
            "requests prefilled on their decode instance because no prefill instance answered",
            value=self.prefill_fallbacks,
        )

    async def _prefill_or_local(
        self, req: GenerationRequest, sampling: dict[str, Any]
    ) -> tuple[dict[str, Any] | None, PromptLogprobs | None]:
        """The prefill's kv params (and the prompt's logprobs, if asked for), or
        (None, None): the decode instance prefills it itself.

        None while no prefill instance answers: none up or reachable, or the
        chosen one went away (or is shutting down, its engine dead) before
        the prefill finished. A refusal of the request itself (400) or another
        failure of the engine is the client's answer as before.
        """
        try:
            kv_params, prompt = await self._prefill(req, sampling)
        except BackendUnavailable as exc:
            if not self.prefill_fallback:
                raise
            self.prefill_fallbacks += 1
            if self._episode is None:
                self._episode = 0
                log.warning(
                    "prefill_unavailable_decode_prefills",
                    request_id=req.request_id,
                    error=str(exc),
                )
            self._episode += 1
            return None, None
        if self._episode is not None:
            log.info("prefill_available_again", requests_prefilled_on_decode=self._episode)
            self._episode = None
        return kv_params, prompt

    async def _connect(self, member: Member) -> WorkerClient:
        try:
            return await self.pool.get(member.address)
        except (OSError, ConnectionLost, TimeoutError) as exc:
            self.directory.mark_down(member.address)
            raise BackendUnavailable(
                f"{member.role} instance {member.instance} unreachable: {exc}"
            ) from exc

    async def pick_reachable(
        self, role: str, policy: str, tokens: int, attempts: int = 8
    ) -> Member:
        """Pick an instance by ``policy`` and connect to it.

        One that refuses the connection (dead, its reports not yet stale) is
        marked down and the next pick skips it, so a request goes to another
        live instance instead of failing; 503 only when none is reachable.
        """
        for _ in range(attempts - 1):
            member = self.directory.pick(role, policy, tokens)
            try:
                await self._connect(member)
            except BackendUnavailable as exc:
                log.warning(
                    "instance_unreachable_trying_another", instance=member.instance, error=str(exc)
                )
                continue
            return member
        member = self.directory.pick(role, policy, tokens)
        await self._connect(member)
        return member

    async def pick_decode(self, prompt_tokens: int) -> Member:
        """The decode instance for a request of ``prompt_tokens``, by the
        scheduler's published policy, or ``proxy.dispatch`` while none is
        published (or the scheduler's is stale). It joins holding the prompt's
        KV and the prefill's first token: ``prompt_tokens + 1``, as in the
        simulator."""
        policy = self.directory.policy(self.policy)
        return await self.pick_reachable("decode", policy, prompt_tokens + 1)

    async def _prefill(
        self, req: GenerationRequest, sampling: dict[str, Any]
    ) -> tuple[dict[str, Any], PromptLogprobs | None]:
        """The prefill's kv params, and the prompt's logprobs when the request asked for them."""
        member = await self.pick_reachable("prefill", "current-load", len(req.prompt_token_ids))
        client = await self._connect(member)
        stream = client.open()
        finished = False
        prompt: PromptLogprobs | None = None
        try:
            await client.send(
                Generate(stream.id, f"{req.request_id}-p", list(req.prompt_token_ids), sampling)
            )
            while True:
                msg = await stream.next()
                if isinstance(msg, Error):
                    raise error_from(msg, member.instance)
                if isinstance(msg, PromptLogprobs):
                    prompt = msg
                if isinstance(msg, Tokens) and msg.finish_reason is not None:
                    finished = True
                    if not msg.kv_transfer_params:
                        raise BackendError(
                            f"prefill on {member.instance} returned no kv_transfer_params"
                        )
                    return dict(msg.kv_transfer_params), prompt
        except ConnectionLost as exc:
            raise BackendUnavailable(
                f"prefill instance {member.instance} went away: {exc}"
            ) from exc
        finally:
            stream.close()
            if not finished:
                await _abort(client, stream.id)

    async def _decode(
        self, req: GenerationRequest, sampling: dict[str, Any], kv_params: dict[str, Any] | None
    ) -> AsyncIterator[TokenBatch]:
        """Decode on the chosen instance; migrations re-route it (:mod:`proxy.migration`).

        Without ``kv_params`` (no prefill instance answered) the instance
        prefills the prompt itself; the run is the same from there on (a
        recovery's legs start that way too), migrations included.
        """
        member = await self.pick_decode(len(req.prompt_token_ids))
        run = DecodeRun(
            self,
            req,
            sampling,
            None if req.migratable else migration_blocker(sampling) or "not migratable",
        )
        self._emit(
            Event.now(
                EventKind.DISPATCHED,
                self.origin,
                request=req.request_id,
                instance=member.instance,
                detail="" if kv_params is not None else "local prefill",
            )
        )
        begin = functools.partial(run.start, member.instance, member.address, kv_params)
        async for batch in self.run_decode(req, run, member.instance, begin):
            yield batch

    async def run_decode(
        self,
        req: GenerationRequest,
        run: DecodeRun,
        instance: str,
        begin: Callable[[], Awaitable[None]],
    ) -> AsyncIterator[TokenBatch]:
        """Relay ``run``'s tokens once ``begin()`` has opened its first leg (on ``instance``)."""
        self.runs[req.request_id] = run
        outcome = "aborted"
        try:
            await begin()
            async for batch in run.run():
                if batch.finish_reason is not None:
                    outcome = batch.finish_reason
                yield batch
        except ConnectionLost as exc:
            outcome = "error"
            raise BackendError(
                f"decode instance {run.instance or instance} went away: {exc}"
            ) from exc
        except BackendError:
            outcome = "error"
            raise
        finally:
            self.runs.pop(req.request_id, None)
            self.migrator.finished_request(req.request_id)
            if outcome in ("stop", "length"):
                self.directory.finished(len(run.generated))
            self._emit(
                Event.now(
                    EventKind.FINISHED,
                    self.origin,
                    request=req.request_id,
                    instance=run.where or instance,
                    detail=outcome,
                    data={
                        "generated": len(run.generated),
                        # The live predictor accuracy's origin for progress (star.predictor.live).
                        "prompt_tokens": len(req.prompt_token_ids),
                        "migrations": run.migrations,
                        "recoveries": run.recoveries,
                    },
                )
            )

    # -- a stream another proxy ran (proxy.adopt) -------------------------------------

    async def attach_stream(self, request_id: str) -> Found | None:
        """Take ``request_id`` over from the decode worker that holds it (None: none does)."""
        where = self.directory.running_on(request_id)  # from the reports; else every one
        members = sorted(self.directory.members("decode"), key=lambda m: m.instance != where)
        return await adopt.attach(self.pool, [(m.instance, m.address) for m in members], request_id)

    def serve_attached(self, req: GenerationRequest, found: Found) -> AsyncIterator[TokenBatch]:
        """The taken-over request's new tokens, as :meth:`generate` would yield them."""
        return adopt.serve(self, req, found)

    # -- what a DecodeRun needs (proxy.decode_run.Fleet) -------------------------------

    def emit_event(self, event: Event) -> None:
        self._emit(event)

    async def rejoin(self, instance: str, address: str, request_id: str) -> Found | None:
        """``request_id`` on ``instance`` again after this proxy's connection to it
        broke (:meth:`proxy.decode_run.DecodeRun._rejoin`); None: not held there."""
        return await adopt.attach(self.pool, [(instance, address)], request_id)

    async def open_leg(self, address: str) -> Stream:
        client = await self.pool.get(address)
        return client.open()

    def decode_members(self) -> list[tuple[str, str]]:
        return [(m.instance, m.address) for m in self.directory.members("decode")]

    def mark_down(self, address: str) -> None:
        self.directory.mark_down(address)

    def decode_address(self, instance: str) -> str | None:
        """Address of a live decode instance (None: not live; see :meth:`Directory.address`)."""
        return self.directory.address("decode", instance)


async def _abort(client: Any, stream_id: int) -> None:
    try:
        await client.send(Abort(stream_id))
    except ConnectionLost:
        pass  # the worker is gone; it frees the KV when it notices


__all__ = ["ClusterBackend", "Directory", "Member"]
