"""Migration failures with real processes lost or stalled (issue 6 item 5, docs/design.md §5.4).

Each test stops or kills real processes of the package fleet at a chosen
phase of a handoff and checks the defined outcome: the client's stream is
the complete, correct one (greedy: equal to the unmigrated run) -- the target
recomputes prompt + generated tokens when the source's KV cannot be read --
or, when the proxy itself is gone, the decode worker aborts the request and
frees its KV. Phases are pinned by pausing the target's engine processes
(SIGSTOP: its token server still takes the request, its engine cannot pull)
until the failure is in place, never by timing. A killed process is started
again and waited for, so the fleet is whole for the next test; every test
ends with the engines' KV usage back to idle.
"""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import httpx
import pytest

from star.bus import Bus
from star.fleet import LocalCluster, group_members, manual_decision
from star.wire import EventKind
from tests.migration.conftest import (
    DECODE,
    TTL_S,
    Completion,
    assert_same,
    complete,
    decode_used,
    engine_paused,
    kill,
    release_to,
    restart,
    run_in_bursts,
    signal_all,
    source_paused,
    stream_with,
    wait_event,
    wait_kv_idle,
    wait_new_worker,
)
from tests.migration.test_fleet import all_events, other, prompt
from tests.migration.test_fleet import pytestmark as fleet_marks

pytestmark = fleet_marks  # the same fleet, the same skip rule


@pytest.fixture(autouse=True)
async def whole_fleet(fleet: LocalCluster, bus: Bus) -> None:
    """Each test starts with the whole fleet up.

    A test that fails between killing a process and starting it again would
    otherwise fail every later one with it (a decision naming a dead target
    is refused, say); here such a process is started again first.
    """
    reports = await bus.latest_reports()
    dead = [c.name for c in fleet.launcher.children if c.proc and c.proc.poll() is not None]
    for name in dead:
        restart(fleet, name)
    for name in dead:
        if name in reports:
            await wait_new_worker(bus, fleet, name, reports[name].address)
    await asyncio.to_thread(fleet.wait_ready, 300)


# A handoff must carry this many tokens: vLLM recomputes one under
# kv_recompute_threshold (64) tokens instead of pulling it.
PULL_AFTER = 96
TOKENS = 400  # enough after the decision; shorter than MAX_TOKENS (slow on a loaded box)


async def stream_paused(
    fleet: LocalCluster,
    bus: Bus,
    p: str,
    scenario: Callable[[str, str, Callable[[], None]], Awaitable[None]],
) -> Completion:
    """Stream ``p`` with its decode engine paused once it runs; then ``scenario``.

    The engine runs in short bursts until the client has ``PULL_AFTER``
    chunks (each at least one token; while it is paused the client catches
    up), so a handoff carries enough tokens to be pulled, yet a fast engine
    cannot end the request first. ``scenario(request, source, resume)`` runs
    with the source paused; ``resume()`` lets it run on.
    """
    seen: list[Completion] = []

    async def on_first(c: Completion) -> None:
        if not seen:
            seen.append(c)

    async def drive(request: str) -> None:
        async with source_paused(fleet, bus, request) as (source, pids):

            async def pullable() -> bool:
                return seen[0].chunks >= PULL_AFTER

            await run_in_bursts(pids, pullable, f"{PULL_AFTER} chunks from {source}")
            await scenario(request, source, lambda: signal_all(pids, signal.SIGCONT))

    return await stream_with(fleet, p, TOKENS, drive, on_chunk=on_first)


class Log:
    """What a process wrote to its log since now (the log of a restarted one is renamed)."""

    def __init__(self, fleet: LocalCluster, name: str) -> None:
        self.path = Path(fleet.run_dir) / f"{name}.log"
        self.start = self.path.stat().st_size

    def since(self) -> str:
        with self.path.open("rb") as f:
            f.seek(self.start)
            return f.read().decode(errors="replace")


async def wait_gone(pgid: int, within_s: float = 120.0) -> None:
    deadline = time.monotonic() + within_s
    while group_members({pgid}):
        assert time.monotonic() < deadline, f"process group {pgid} still alive"
        await asyncio.sleep(0.05)


async def test_source_dies_after_the_handoff_the_target_recomputes(
    fleet: LocalCluster, bus: Bus
) -> None:
    """ABORTED_SRC after the release: the source is killed before the target pulls its KV.

    The Handoff has reached the proxy and the continuation the target, but
    the target's engine is paused; the source's whole process group is then
    killed, so the NIXL read can only fail. The target recomputes prompt +
    every token sent, and the client's stream is the unmigrated one.
    """
    p = prompt(30)
    seen: dict[str, str] = {}
    logs: dict[str, Log] = {}

    async def scenario(request: str, source: str, resume: Callable[[], None]) -> None:
        target = other(source)
        seen.update(
            request=request,
            source=source,
            target=target,
            address=(await bus.latest_reports())[source].address,
        )
        logs[target] = Log(fleet, target)
        source_pgid = fleet.pids()[source]
        with engine_paused(fleet, target):
            released = await release_to(bus, request, source, target, resume)
            kill(fleet, source)
            await wait_gone(source_pgid)
        seen["held_s"] = f"{time.time() - released.ts:.1f}"

    got = await stream_paused(fleet, bus, p, scenario)
    # The reference runs after: had it run first, the target could hold the
    # whole sequence in its prefix cache and need no pull at all.
    ref = await complete(fleet, p, TOKENS)
    assert_same(got, ref, TOKENS)
    # The pull failed (no handshake, or the read itself; vLLM 0.32's wording).
    # Had the target come back within 5 s of the hold's end, it would have
    # declined the read without trying it (once it knows the source: after an
    # earlier pull from it) -- the same outcome by another path.
    assert "NIXL transfer failure" in logs[seen["target"]].since(), (
        f"no failed read: the target ran again {seen['held_s']} s after the release"
        f" (hold {TTL_S} s)"
    )
    evs = await all_events(bus, got.id)
    kinds = [(e.event, e.instance) for e in evs]
    assert (EventKind.RELEASED, seen["source"]) in kinds
    assert (EventKind.RESUMED, seen["target"]) in kinds
    assert not [e for e in evs if e.event is EventKind.ABORTED]
    finished = [e for e in evs if e.event is EventKind.FINISHED]
    assert finished[-1].instance == seen["target"]
    assert finished[-1].data["migrations"] == 1

    restart(fleet, seen["source"])
    await wait_new_worker(bus, fleet, seen["source"], seen["address"])
    await wait_kv_idle(bus, TTL_S + 160)


async def test_a_pull_after_the_source_freed_the_blocks_recomputes(
    fleet: LocalCluster, bus: Bus
) -> None:
    """The NIXL read comes too late: the source's hold expired and its blocks are free.

    The target's engine is paused from before the decision until the source
    has freed the released blocks (its hold, ``decoder_kv_blocks_ttl`` =
    ``TTL_S`` here, ran out: its reported KV use is back to zero). vLLM then
    declines the expired read instead of reading blocks that may already hold
    another request's KV, and the target recomputes.
    """
    p = prompt(31)
    seen: dict[str, str] = {}
    logs: dict[str, Log] = {}

    async def scenario(request: str, source: str, resume: Callable[[], None]) -> None:
        target = other(source)
        seen.update(source=source, target=target)
        logs[target] = Log(fleet, target)
        with engine_paused(fleet, target):
            await release_to(bus, request, source, target, resume)
            deadline = time.monotonic() + TTL_S + 120
            while (await decode_used(bus)).get(source, 1):
                assert time.monotonic() < deadline, "the source never freed the released blocks"
                await asyncio.sleep(0.25)

    got = await stream_paused(fleet, bus, p, scenario)
    ref = await complete(fleet, p, TOKENS)  # after: no prefix-cache hit on the target
    assert_same(got, ref, TOKENS)
    evs = await all_events(bus, got.id)
    assert (EventKind.RESUMED, seen["target"]) in [(e.event, e.instance) for e in evs]
    assert not [e for e in evs if e.event is EventKind.ABORTED]
    # The read was declined, not served from freed blocks (vLLM 0.32's pull_worker.py).
    assert "Declining expired remote read" in logs[seen["target"]].since()
    await wait_kv_idle(bus, TTL_S + 160)


async def test_the_owning_proxy_dies_the_worker_frees_the_request(
    fleet: LocalCluster, bus: Bus
) -> None:
    """The proxy that owns a decoding request is killed: nothing can deliver its tokens.

    The client's connection breaks; the decode worker sees its proxy
    connection close, aborts the request and frees its KV. A proxy started
    again refuses a later decision naming the request (``unknown request``)
    and serves new requests.
    """
    seen: dict[str, str] = {}

    async def scenario(request: str) -> None:
        # It is decoding there (the client has a token); its engine stands
        # still around the kill, so the request cannot end first.
        async with source_paused(fleet, bus, request) as (instance, _):
            seen.update(request=request, instance=instance)
            seen["killed_at"] = str(time.time())
            kill(fleet, "proxy")

    with pytest.raises(httpx.TransportError):
        await stream_with(fleet, prompt(32), TOKENS, scenario)
    request, instance = seen["request"], seen["instance"]

    # The worker dropped the request and its KV (reports keep coming: it is alive).
    deadline = time.monotonic() + 120
    while True:
        report = (await bus.latest_reports())[instance]
        if (
            report.ts > float(seen["killed_at"])
            and not any(r.id == request for r in report.requests)
            and request not in report.in_flight
        ):
            break
        assert time.monotonic() < deadline, f"{instance} still runs {request}"
        await asyncio.sleep(0.25)
    await wait_kv_idle(bus, TTL_S + 160)

    restart(fleet, "proxy")
    await asyncio.to_thread(fleet.wait_ready, 300)
    await bus.publish("decisions", manual_decision(request, instance, other(instance)))
    await wait_event(
        bus,
        request,
        lambda e: e.event is EventKind.REFUSED and e.detail == "unknown request",
        "refused",
        120,
    )
    short = await complete(fleet, prompt(33), 8)
    assert short.usage["completion_tokens"] == 8 and not short.error
    assert set(DECODE) <= set((await bus.latest_reports()).keys())
