"""Integrity faults (issue 27): someone who can write to Redis but holds no key of
the role it pretends to be, and a decisions stream that goes back.

Each writes to the fleet's Redis directly while the load flows and counts
``forged_applied``: forged or replayed entries that the cluster acted on.
It must be 0.

- ``forged-report``: for 10 s, reports of decode-0 moving its address to a
  trap (a TCP listener in the root namespace) and a load view saying the
  same, written unsigned, signed with another cluster's key, and signed
  with a proxy's key (a role that writes no report). Applied: every
  connection the trap accepts (a proxy dialled the forged address) and
  every sample of the scheduler's signed load view that names the trap.
- ``forged-decision``: for 10 s, decisions moving running requests to the
  other decode instance, with a fence far above the leader's, written
  unsigned, with another cluster's key, with a worker's key and with a
  proxy's key (roles that write no decision). Applied: every forged
  decision id any event names (``migrating``, ``refused``...: a proxy acted
  on it).
- ``decision-replay``: three genuine moves (signed as an operator, as
  ``star migrate`` signs), then the decisions stream goes back, as a
  restored snapshot or a lagging replica would have it: rewritten without
  its newest entry, every other entry with its own id, so every reader
  starts again from ``0-0``. Applied: every replayed decision whose move
  was over before the rewrite (``resumed``, ``aborted``, ``refused``,
  ``expired``, or its request finished) and that a proxy answers again after
  it (``migrating`` or ``refused``: acted on again). A proxy may answer one
  decision ``migrating`` then ``refused`` (the worker would not release):
  that is one application, so only moves already over are counted.

The scenarios are registered in :data:`benchmarks.chaos.scenarios.SCENARIOS`.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import time
from typing import Any, Protocol

import msgspec

from benchmarks.chaos.fleet import SECRET_ENV, NetFleet
from star.bus import Bus
from star.fleet import manual_decision
from star.settings import BusSettings, RedisSettings
from star.wire import Decision, Event, EventKind, LoadEntry, decode_as, encode


class Ctx(Protocol):
    """What these scenarios use of :class:`benchmarks.chaos.scenarios.Ctx` (which
    imports this module, so it is not imported here)."""

    fleet: NetFleet
    extra: dict[str, Any]

    def fault(self) -> None: ...
    def healed(self) -> None: ...
    async def running(
        self, min_left: int = 60, within_s: float = 20.0, avoid: str | None = None
    ) -> tuple[str, str, str]: ...
    async def first_event(
        self, request: str, kinds: set[EventKind], within_s: float
    ) -> Event | None: ...


FORGE_S = 10.0  # how long forged entries are written
EVERY_S = 0.1  # one round of forgeries this often
MOVES = 3  # genuine moves before the decisions stream goes back
ANSWERS = {EventKind.MIGRATING, EventKind.REFUSED}  # a proxy acting on a decision
OVER = {EventKind.RESUMED, EventKind.ABORTED, EventKind.REFUSED, EventKind.EXPIRED}


def _bus(fleet: NetFleet, keys: str | None = None, role: str | None = None) -> Bus:
    """A connection to the fleet's Redis; ``keys``: its secret (None: the fleet's; "": none)."""
    secret = fleet.env[SECRET_ENV] if keys is None else keys
    return Bus.from_settings(RedisSettings(url=fleet.redis_url), BusSettings(), secret, role)


def _forgers(fleet: NetFleet, *roles: str) -> dict[str, Bus]:
    """Writers without the right key: unsigned, another cluster's, and ``roles`` of this one."""
    out = {"unsigned": _bus(fleet, ""), "other_cluster": _bus(fleet, secrets.token_hex(32))}
    out |= {f"{role}_key": _bus(fleet, None, role) for role in roles}
    return out


async def _close(*buses: Bus) -> None:
    for bus in buses:
        with contextlib.suppress(Exception):
            await bus.close()


class Trap:
    """A TCP listener in the root namespace: every connection to it is counted."""

    def __init__(self) -> None:
        self.connections = 0
        self.server: asyncio.Server | None = None

    async def start(self, host: str) -> str:
        def accept(_reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            self.connections += 1
            writer.close()

        self.server = await asyncio.start_server(accept, host, 0)
        port = self.server.sockets[0].getsockname()[1]
        return f"{host}:{port}"

    async def stop(self) -> None:
        if self.server is not None:
            self.server.close()
            await self.server.wait_closed()


async def forged_report(ctx: Ctx) -> None:
    """Reports and a load view moving decode-0 to a trap, by writers without the key."""
    fleet = ctx.fleet
    trap = Trap()
    address = await trap.start(fleet.net.gateway)
    genuine = _bus(fleet)
    forgers = _forgers(fleet, "proxy")
    published = view_samples = trapped_views = 0
    try:
        ctx.fault()
        until = time.monotonic() + FORGE_S
        while time.monotonic() < until:
            real = (await genuine.latest_reports()).get("decode-0")
            if real is not None:
                forged = msgspec.structs.replace(
                    real, address=address, seq=real.seq + 1000, ts=time.time()
                )
                for bus in forgers.values():
                    await bus.publish("reports", forged)
                    published += 1
                entry = LoadEntry("decode-0", "decode", address, 0, real.capacity_tokens, 0.0, 0, time.time())  # fmt: skip
                await genuine.redis.hset(genuine.keys.load, "decode-0", encode(entry))
                published += 1
            view = await genuine.read_load()  # as a proxy reads it: signed by the scheduler
            view_samples += 1
            trapped_views += any(e.address == address for e in view.values())
            await asyncio.sleep(EVERY_S)
        ctx.healed()
        await asyncio.sleep(2.0)  # a dial of the forged address would be under way by now
    finally:
        await trap.stop()
        await _close(genuine, *forgers.values())
    ctx.extra["forged_published"] = published
    ctx.extra["trap_connections"] = trap.connections
    ctx.extra["view_samples"] = view_samples
    ctx.extra["forged_applied"] = trap.connections + trapped_views


async def forged_decision(ctx: Ctx) -> None:
    """Decisions moving running requests, with a high fence, by writers without the key."""
    fleet = ctx.fleet
    forgers = _forgers(fleet, "worker", "proxy")
    genuine = _bus(fleet)
    forged: dict[str, str] = {}  # decision id -> request
    try:
        ctx.fault()
        until = time.monotonic() + FORGE_S
        n = 0
        while time.monotonic() < until:
            try:
                request, source, target = await ctx.running(min_left=20, within_s=3.0)
            except RuntimeError:
                break  # the load is over: nothing left to move
            for kind, bus in forgers.items():
                n += 1
                decision = Decision(
                    f"forged-{kind}-{n}", request, source, target, 0, -1.0, "predicted",
                    time.time(), 1_000_000, "scheduler",
                )  # fmt: skip
                await bus.publish("decisions", decision)
                forged[decision.id] = request
            await asyncio.sleep(EVERY_S * 2.5)
        ctx.healed()
        await asyncio.sleep(3.0)  # what a proxy did with them is on the events stream by now
        acted: set[str] = set()
        for request in set(forged.values()):
            for event in await genuine.request_events(request):
                if event.migration in forged:
                    acted.add(event.migration)
    finally:
        await _close(genuine, *forgers.values())
    ctx.extra["forged_published"] = len(forged)
    ctx.extra["forged_applied"] = len(acted)


async def decision_replay(ctx: Ctx) -> None:
    """Genuine moves, then the decisions stream rewritten without its newest entry."""
    fleet = ctx.fleet
    operator = _bus(fleet, None, "operator")
    reader = _bus(fleet)
    try:
        moved: list[str] = []
        moved_requests: dict[str, str] = {}
        for _ in range(MOVES * 3):
            if len(moved) >= MOVES:
                break
            request, source, target = await ctx.running(min_left=200)
            decision = manual_decision(request, source, target)
            await operator.publish("decisions", decision)
            answer = await ctx.first_event(request, ANSWERS, 20)
            if answer is not None and answer.event is EventKind.MIGRATING:
                moved.append(decision.id)
                moved_requests[decision.id] = request
        ctx.extra["moves"] = len(moved)
        # Each move over (resumed, aborted, refused) before the stream goes back.
        for decision_id in moved:
            await _settled(reader, decision_id, moved_requests[decision_id], 15.0)
        key = reader.keys.decisions
        rows: list[tuple[bytes, dict[bytes, bytes]]] = await reader.redis.xrange(key)  # type: ignore[assignment]
        if len(rows) < 2:
            raise RuntimeError(f"only {len(rows)} decisions on the stream: nothing to replay")
        replayed = {decode_as(f[b"body"], Decision) for _i, f in rows[:-1]}
        by_id = {d.id: d.request for d in replayed}
        # Decisions whose move is over before the rewrite: any answer after it is a replay's.
        settled = {d for d, r in by_id.items() if await _over(reader, d, r)}
        # The stream goes back: its entries as a snapshot taken before the newest one.
        async with reader.redis.pipeline(transaction=True) as pipe:
            pipe.delete(key)
            for entry_id, fields in rows[:-1]:
                pipe.xadd(key, fields, id=entry_id)  # type: ignore[arg-type]
            await pipe.execute()
        ctx.fault()
        wall = time.time()
        await asyncio.sleep(FORGE_S)
        ctx.healed()
        again: set[str] = set()
        for request in {by_id[d] for d in settled}:
            for event in await reader.request_events(request):
                if event.migration in settled and event.event in ANSWERS and event.ts >= wall:
                    again.add(event.migration)
    finally:
        await _close(operator, reader)
    ctx.extra["decisions_replayed"] = len(replayed)
    ctx.extra["settled_replayed"] = len(settled)
    ctx.extra["forged_applied"] = len(again)


async def _over(bus: Bus, decision_id: str, request: str) -> bool:
    """Whether the move of ``decision_id`` is over (or its request finished)."""
    for event in await bus.request_events(request):
        if event.migration == decision_id and event.event in OVER:
            return True
        if event.event is EventKind.FINISHED:
            return True
    return False


async def _settled(bus: Bus, decision_id: str, request: str, within_s: float) -> None:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline and not await _over(bus, decision_id, request):  # noqa: ASYNC110
        await asyncio.sleep(0.2)


INTEGRITY = {
    "forged-report": forged_report,
    "forged-decision": forged_decision,
    "decision-replay": decision_replay,
}

__all__ = ["INTEGRITY"]
