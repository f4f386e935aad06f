"""The faults: each one injected into a fleet while the steady load flows.

A scenario is an async function of a :class:`Ctx`; it calls ``ctx.fault()``
when the fault starts and ``ctx.healed()`` when it is over (the process is
started again, the partition lifted), and may add measurements to
``ctx.extra``. The runner (:mod:`benchmarks.chaos.run`) starts the load,
calls the scenario a few seconds in, then checks what every client got.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import signal
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from benchmarks.chaos.fleet import NetFleet
from benchmarks.chaos.integrity import INTEGRITY
from star.aio import deadline
from star.bus import Bus
from star.fleet import group_members, manual_decision
from star.settings import BusSettings
from star.wire import Event, EventKind

_NOT_MOVED = {EventKind.REFUSED, EventKind.FINISHED, EventKind.ABORTED, EventKind.EXPIRED}
PARTITION_S = 10.0  # how long a partition lasts
LONG_PARTITION_S = 60.0  # a partition past TCP's retransmission backoff
SHAPED_S = 15.0  # how long a link stays delayed or lossy
REDIS_DOWN_S = 3.0  # how long Redis stays dead before it is started again
DRAIN_BOUND_S = 40.0  # proxy.drain_timeout_s (30 s) and 10 s to exit, then SIGKILL
LEADER_WAIT_S = 10.0  # how long a scheduler fault waits for a leader to strike


@dataclass
class Ctx:
    fleet: NetFleet
    fault_at: float = 0.0
    healed_at: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)
    background: list[asyncio.Task[None]] = field(default_factory=list)

    def fault(self) -> None:
        self.fault_at = time.monotonic()

    def healed(self) -> None:
        self.healed_at = time.monotonic()

    def since_fault(self) -> float:
        return round(time.monotonic() - self.fault_at, 2)

    async def bus_call(self, call: Callable[[Bus], Awaitable[Any]], within_s: float = 5.0) -> Any:
        return await bus_call(self.fleet, call, within_s)

    async def reported_since(self, instances: list[str], since: float) -> bool:
        """Whether each of ``instances`` has a report stamped after ``since`` (wall time)."""
        reports = await self.bus_call(lambda b: b.latest_reports())
        return all(n in reports and reports[n].ts > since for n in instances)

    async def first_event(
        self, request: str, kinds: set[EventKind], within_s: float
    ) -> Event | None:
        """The first of ``request``'s events of one of ``kinds`` (None: none within ``within_s``)."""
        deadline = time.monotonic() + within_s
        while time.monotonic() < deadline:
            events: list[Event] = await self.bus_call(lambda b: b.request_events(request))
            found = [e for e in events if e.event in kinds]
            if found:
                return found[0]
            await asyncio.sleep(0.02)
        return None

    async def running(
        self, min_left: int = 60, within_s: float = 20.0, avoid: str | None = None
    ) -> tuple[str, str, str]:
        """A request decoding with ``min_left`` tokens to go: (request, its instance, another).

        ``avoid``: an instance whose requests are not picked (a paused one).
        """
        names = self.fleet.decode_names
        deadline = time.monotonic() + within_s
        while time.monotonic() < deadline:
            reports = await self.bus_call(lambda b: b.latest_reports())
            for name in names:
                if name == avoid:
                    continue
                report = reports.get(name)
                for r in report.requests if report is not None else []:
                    if r.migratable and (r.true_remaining or 0) >= min_left:
                        return r.id, name, next(n for n in names if n != name)
            await asyncio.sleep(0.2)
        raise RuntimeError(f"no request with {min_left} tokens to go on any decode instance")

    async def move(self, hold: Hold | None = None, attempts: int = 5) -> tuple[str, str, str]:
        """Start a move of a running request; returns once the proxy acts on it (``migrating``).

        A decision can be refused (the request finished meanwhile, or is not
        releasable yet): then another request is tried. With ``hold``, the
        target is the held (paused) instance. Returns (request, source, target).
        """
        seen: list[str] = []
        for _ in range(attempts):
            request, source, target = await self.running(avoid=hold.name if hold else None)
            if hold is not None:
                target = hold.name
            decision = manual_decision(request, source, target)
            await self.bus_call(functools.partial(Bus.publish, stream="decisions", msg=decision))
            answer = await self.first_event(request, {EventKind.MIGRATING} | _NOT_MOVED, 20)
            if answer is not None and answer.event is EventKind.MIGRATING:
                return request, source, target
            seen.append(
                "no answer in 20 s"
                if answer is None
                else f"{answer.event.value} {answer.detail}".strip()
            )
        raise RuntimeError(f"no move started in {attempts} tries: {seen}")

    async def wait_event(self, request: str, kind: EventKind, within_s: float = 30.0) -> None:
        if await self.first_event(request, {kind}, within_s) is None:
            raise RuntimeError(f"no {kind.value} event for {request} within {within_s} s")

    @contextlib.contextmanager
    def paused_target(self) -> Iterator[Hold]:
        """The last decode instance's engine processes stopped (SIGSTOP) for the block.

        Its worker still takes connections and handoffs, but its engine
        neither steps nor pulls KV until the block ends (SIGCONT, always).
        """
        name = self.fleet.decode_names[-1]
        leader = self.fleet.pid(name)
        pids = [pid for pid, _g, _n in group_members({leader}) if pid != leader]
        if not pids:
            raise RuntimeError(f"{name} has no engine processes")
        _signal(pids, signal.SIGSTOP)
        try:
            yield Hold(name, pids)
        finally:
            _signal(pids, signal.SIGCONT)

    async def leader(self) -> str:
        """The node holding the scheduler's leader lock ('' if none)."""
        try:
            value = await self.bus_call(lambda b: b.redis.get(b.keys.leader), 2.0)
        except Exception:  # Redis down or restarting: no leader to be seen; the callers poll
            return ""
        return value.decode().split("|")[0] if value else ""

    async def next_leader(self, not_node: str = "", within_s: float = 60.0) -> str:
        """The first node other than ``not_node`` seen leading within ``within_s`` ('' if none)."""
        deadline = time.monotonic() + within_s
        while time.monotonic() < deadline:
            node = await self.leader()
            if node and node != not_node:
                return node
            await asyncio.sleep(0.1)
        return ""

    async def wait_leader(self, not_node: str, within_s: float = 60.0) -> float | None:
        """Seconds from the fault until a node other than ``not_node`` leads."""
        return self.since_fault() if await self.next_leader(not_node, within_s) else None

    async def leader_to_strike(self) -> str:
        """The leader a scheduler fault is aimed at. The lock can lapse for a moment
        on a loaded box (a 1.5 s TTL: seen once while the previous scenario's engine
        restarted), so a leader is waited for, up to :data:`LEADER_WAIT_S`."""
        leader = await self.next_leader(within_s=LEADER_WAIT_S)
        if not leader:
            raise RuntimeError(f"no scheduler leads (waited {LEADER_WAIT_S:g} s)")
        return leader

    async def reports_resumed(self, instances: list[str], within_s: float = 90.0) -> float | None:
        """Seconds from the heal until each of ``instances`` has reported since."""
        since = time.time() - (time.monotonic() - self.healed_at)
        deadline = time.monotonic() + within_s
        while time.monotonic() < deadline:
            with contextlib.suppress(Exception):
                if await self.reported_since(instances, since):
                    return round(time.monotonic() - self.healed_at, 2)
            await asyncio.sleep(0.2)
        return None

    def restart(self, name: str) -> None:
        """Start ``name`` again; note in ``extra`` how long until it serves again.

        A worker is back when it reports again, the proxy when it answers
        ``/health``; Redis is waited for by :meth:`NetFleet.restart` itself.
        """
        self.fleet.restart(name)
        started = time.monotonic()
        since = time.time()

        async def serving() -> bool:
            if name in self.fleet.worker_names:
                return await self.reported_since([name], since)
            if name in self.fleet.proxy_names:
                url = self.fleet.url_of(name)
                return await asyncio.to_thread(self.fleet.health, url) is not None
            return True

        async def back() -> None:
            while time.monotonic() - started < 300:
                with contextlib.suppress(Exception):
                    if await serving():
                        self.extra[f"{name}_back_s"] = round(time.monotonic() - started, 1)
                        return
                await asyncio.sleep(0.5)

        if name in self.fleet.worker_names or name in self.fleet.proxy_names:
            self.background.append(asyncio.create_task(back()))


@dataclass(frozen=True)
class Hold:
    """A decode instance whose engine is paused (:meth:`Ctx.paused_target`)."""

    name: str
    pids: list[int]


def _signal(pids: list[int], sig: signal.Signals) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


async def bus_call(fleet: NetFleet, call: Callable[[Bus], Awaitable[Any]], within_s: float) -> Any:
    """One bus query on a fresh connection (Redis may have been restarted since the last),
    signed with the fleet's secret (a decision published unsigned is dead-lettered)."""
    bus = Bus.from_settings(fleet.redis_settings(), BusSettings(), fleet.secret)
    try:
        async with deadline(within_s):
            return await call(bus)
    finally:
        with contextlib.suppress(Exception):
            await bus.close()


Scenario = Callable[[Ctx], Awaitable[None]]


async def nothing(ctx: Ctx) -> None:
    """No fault: the reference repeated (what an unfaulted run measures)."""
    ctx.fault()
    ctx.healed()


async def decode_kill(ctx: Ctx) -> None:
    """SIGKILL decode-0 (worker and engine) mid-stream; systemd starts it again."""
    ctx.fault()
    ctx.fleet.kill("decode-0")
    ctx.healed()
    ctx.restart("decode-0")


async def decode_kill_mid_handoff(ctx: Ctx) -> None:
    """A move between decode instances held mid-handoff; SIGKILL its source, then let it go on.

    The target's engine is paused (SIGSTOP) before the decision, so the
    source releases and hands off but the target cannot pull yet: the
    source dies holding the blocks the target was about to read.
    """
    await _kill_mid_handoff(ctx, victim=0)


async def target_kill_mid_pull(ctx: Ctx) -> None:
    """A move between decode instances held mid-handoff; SIGKILL its target, then let it go on.

    The target's engine is paused (SIGSTOP) before the decision, so the
    source releases and hands off but the target has not pulled yet: the
    target dies with the handoff taken and the KV unread on the source.
    """
    await _kill_mid_handoff(ctx, victim=1)


async def _kill_mid_handoff(ctx: Ctx, victim: int) -> None:
    """Hold a move after the source's release; SIGKILL its source (0) or target (1)."""
    with ctx.paused_target() as hold:
        request, source, target = await ctx.move(hold)
        await ctx.wait_event(request, EventKind.RELEASED)
        ctx.extra["moved"] = request
        killed = (source, target)[victim]
        ctx.fault()
        ctx.fleet.kill(killed)
    ctx.healed()
    ctx.extra["killed"] = killed
    ctx.restart(killed)


async def prefill_kill(ctx: Ctx) -> None:
    """SIGKILL the only prefill worker; started again at once (new requests wait for it)."""
    ctx.fault()
    ctx.fleet.kill("prefill-0")
    ctx.healed()
    ctx.restart("prefill-0")


async def proxy_kill(ctx: Ctx) -> None:
    """SIGKILL the proxy (every open stream is cut); started again after 1 s."""
    ctx.fault()
    ctx.fleet.kill("proxy")
    await asyncio.sleep(1.0)
    ctx.healed()
    ctx.restart("proxy")


async def proxy_kill_resume(ctx: Ctx) -> None:
    """SIGKILL the proxy; its clients resume (on the other proxy, or on this one once it is
    back): the decode workers hold their requests (worker.orphan_grace_s) for a proxy to
    take over."""
    await proxy_kill(ctx)


async def proxy_restart_resume(ctx: Ctx) -> None:
    """SIGTERM the proxy; what its drain leaves is handed to the workers, and its clients
    resume elsewhere (a rolling restart with resuming clients)."""
    await proxy_restart(ctx)


async def proxy_restart(ctx: Ctx) -> None:
    """SIGTERM the proxy mid-load, as a rolling restart does; started again once it exits.

    The proxy stops taking requests and finishes its open streams within
    ``proxy.drain_timeout_s`` (30 s) before it exits; ``proxy_exit_s`` is how
    long that took (None: still there at the bound + 10 s, then SIGKILLed).
    """
    ctx.fault()
    took = await asyncio.to_thread(ctx.fleet.terminate, "proxy", DRAIN_BOUND_S)
    ctx.extra["proxy_exit_s"] = None if took is None else round(took, 1)
    ctx.healed()
    ctx.restart("proxy")


async def scheduler_kill(ctx: Ctx) -> None:
    """SIGKILL the scheduler leader; the standby takes over."""
    leader = await ctx.leader_to_strike()
    ctx.fault()
    ctx.fleet.kill(leader)
    ctx.healed()
    ctx.extra["new_leader_s"] = await ctx.wait_leader(leader)
    ctx.restart(leader)


async def redis_kill(ctx: Ctx) -> None:
    """SIGKILL Redis (no persistence: streams and keys are gone); started again after 3 s."""
    await _redis_kill(ctx)


async def redis_kill_persistent(ctx: Ctx) -> None:
    """SIGKILL Redis running with its append-only file; it comes back with its data."""
    await ctx.fleet.persistence(True)
    await _redis_kill(ctx)


async def _redis_kill(ctx: Ctx) -> None:
    ctx.fault()
    ctx.fleet.kill("redis")
    await asyncio.sleep(REDIS_DOWN_S)
    ctx.fleet.restart("redis")
    ctx.healed()
    ctx.extra["reports_resumed_s"] = await ctx.reports_resumed(ctx.fleet.worker_names)
    ctx.extra["leader_s"] = await ctx.wait_leader("")


async def redis_failover(ctx: Ctx) -> None:
    """SIGKILL the Redis master; the Sentinels promote its replica (``--sentinel`` fleet).

    The old master is started again 3 s after the promotion (empty, no
    persistence), as systemd would: the Sentinels make it a replica of the
    new master, and every process must have left it.
    """
    if not ctx.fleet.sentinel:
        raise RuntimeError("redis-failover needs a fleet with Sentinels (bench chaos --sentinel)")
    before = await asyncio.to_thread(ctx.fleet.master)
    ctx.fault()
    ctx.fleet.kill("redis" if before == "redis" else "redis-1")
    until = time.monotonic() + 60
    while (now := await asyncio.to_thread(ctx.fleet.master)) in (before, ""):
        if time.monotonic() > until:
            raise RuntimeError(
                f"the Sentinels did not promote a replica within 60 s (master {now!r})"
            )
        await asyncio.sleep(0.2)
    ctx.extra["promoted_s"] = ctx.since_fault()
    ctx.extra["master"] = f"{before} > {now}"
    await asyncio.sleep(REDIS_DOWN_S)
    ctx.fleet.restart("redis" if before == "redis" else "redis-1")
    ctx.healed()
    ctx.extra["reports_resumed_s"] = await ctx.reports_resumed(ctx.fleet.worker_names)
    ctx.extra["leader_s"] = await ctx.wait_leader("")


async def partition_worker_redis(ctx: Ctx) -> None:
    """decode-0 cut from Redis for 10 s (its streams to the proxy go on)."""
    await _partition(ctx, "d0", "redis")
    ctx.extra["reports_resumed_s"] = await ctx.reports_resumed(["decode-0"])


async def partition_proxy_decode(ctx: Ctx) -> None:
    """The proxy cut from decode-0 for 10 s, mid-stream."""
    await _partition(ctx, "proxy", "d0")


async def partition_proxy_decode_long(ctx: Ctx) -> None:
    """The proxy cut from decode-0 for 60 s, past TCP's retransmission backoff, mid-stream."""
    await _partition(ctx, "proxy", "d0", LONG_PARTITION_S)


async def redis_oom(ctx: Ctx) -> None:
    """Redis full for 10 s (``maxmemory`` set to what it holds: every write gets OOM)."""
    import redis.asyncio as aioredis

    client = aioredis.Redis.from_url(ctx.fleet.redis_url, socket_timeout=5)
    try:
        used = int((await client.info("memory"))["used_memory"])
        await client.config_set("maxmemory-policy", "noeviction")
        await client.config_set("maxmemory", str(max(1, used // 2)))
        ctx.fault()
        try:
            await client.xadd(b"chaos:probe", {b"x": b"1"})
            ctx.extra["oom"] = "no"  # the write went through: the fault did not take
        except aioredis.ResponseError as exc:
            ctx.extra["oom"] = "yes" if "maxmemory" in str(exc) else str(exc)[:60]
        await asyncio.sleep(PARTITION_S)
        await client.config_set("maxmemory", "0")
        ctx.healed()
    finally:
        await client.aclose()
    ctx.extra["reports_resumed_s"] = await ctx.reports_resumed(ctx.fleet.worker_names)


async def partition_decode_pull(ctx: Ctx) -> None:
    """Two decode hosts cut from each other while a KV pull between them is due.

    The target's engine is held (SIGSTOP) until the source has released and
    the partition is in place, so the pull itself runs into the partition.
    """
    with ctx.paused_target() as hold:
        request, source, target = await ctx.move(hold)
        await ctx.wait_event(request, EventKind.RELEASED)
        ctx.extra["moved"] = request
        ctx.fleet.net.partition(ctx.fleet.host_of(source), ctx.fleet.host_of(target))
        ctx.fault()
    await asyncio.sleep(PARTITION_S)
    ctx.fleet.net.heal()
    ctx.healed()


async def partition_scheduler_redis(ctx: Ctx) -> None:
    """The scheduler leader's host cut from Redis for 10 s; the standby takes over."""
    leader = await ctx.leader_to_strike()
    host = ctx.fleet.host_of(leader)
    ctx.fleet.net.partition(host, "redis")
    ctx.fault()
    ctx.extra["new_leader_s"] = await ctx.wait_leader(leader)
    await asyncio.sleep(max(0.0, PARTITION_S - (time.monotonic() - ctx.fault_at)))
    ctx.fleet.net.heal()
    ctx.healed()


async def link_delay(ctx: Ctx) -> None:
    """50 ms each way on the proxy's link (to the workers and the clients) for 15 s."""
    await _shaped(ctx, delay_ms=50)


async def link_loss(ctx: Ctx) -> None:
    """5 % of frames dropped each way on the proxy's link for 15 s."""
    await _shaped(ctx, loss_pct=5)


async def _shaped(ctx: Ctx, delay_ms: float = 0.0, loss_pct: float = 0.0) -> None:
    ctx.fleet.net.shape("proxy", delay_ms=delay_ms, loss_pct=loss_pct)
    ctx.fault()
    await asyncio.sleep(SHAPED_S)
    ctx.fleet.net.shape("proxy")
    ctx.healed()


async def _partition(ctx: Ctx, a: str, b: str, seconds: float = PARTITION_S) -> None:
    ctx.fleet.net.partition(a, b)
    ctx.fault()
    await asyncio.sleep(seconds)
    ctx.fleet.net.heal()
    ctx.healed()


# name -> (scenario, in --quick)
SCENARIOS: dict[str, tuple[Scenario, bool]] = {
    "none": (nothing, True),
    "decode-kill": (decode_kill, True),
    "decode-kill-mid-handoff": (decode_kill_mid_handoff, False),
    "target-kill-mid-pull": (target_kill_mid_pull, False),
    "prefill-kill": (prefill_kill, False),
    "proxy-kill": (proxy_kill, False),
    "proxy-restart": (proxy_restart, False),
    "proxy-kill-resume": (proxy_kill_resume, True),
    "proxy-restart-resume": (proxy_restart_resume, False),
    "scheduler-kill": (scheduler_kill, True),
    "redis-kill": (redis_kill, False),
    "redis-kill-persistent": (redis_kill_persistent, False),
    "redis-failover": (redis_failover, False),
    "partition-worker-redis": (partition_worker_redis, False),
    "partition-proxy-decode": (partition_proxy_decode, True),
    "partition-proxy-decode-long": (partition_proxy_decode_long, False),
    "redis-oom": (redis_oom, False),
    "partition-decode-pull": (partition_decode_pull, False),
    "partition-scheduler-redis": (partition_scheduler_redis, False),
    "link-delay-50ms": (link_delay, False),
    "link-loss-5pct": (link_loss, True),
}
SCENARIOS |= {name: (scenario, False) for name, scenario in INTEGRITY.items()}
# Their clients resume a cut stream (GET /v1/streams/{last id}) instead of giving up.
RESUMING = frozenset({"proxy-kill-resume", "proxy-restart-resume"})
