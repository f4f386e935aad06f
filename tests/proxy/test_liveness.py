"""Liveness of token-protocol connections through a relay that goes silent (issue 26 item 4).

A real :class:`WorkerClient` (and a real :class:`ClusterBackend` over a real
:class:`WorkerPool`) talks to real :class:`TokenServer`\\ s with the scripted
engine of ``tests/workers/fakes.py``, through a user-space TCP relay
(``tests/proxy/relay.py``) that stops forwarding mid-stream without closing
anything: a silent partition, which no RST ends. Both ends must notice within
the liveness bound: the proxy's streams get ``ConnectionLost`` (a request
continues on another instance, once), the worker aborts the request. An idle
connection through a working relay stays up: heartbeats flow.

Timing: the bound is ``BOUND`` (0.6 s) here, the default 2 s in one test;
each detection is asserted within the bound plus ``SLACK`` (0.3 s: the
check runs at the deadline itself, the rest is a loaded test box).
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Literal

import pytest

from proxy.backend import GenerationRequest, TokenBatch
from proxy.cluster import ClusterBackend, Directory
from proxy.upstream import ConnectionLost, WorkerClient, WorkerPool
from star.liveness import DEFAULT_TIMEOUT_S
from star.wire import Error, Event, EventKind, FrameDecoder, Generate, Hello, Ping, Tokens, frame
from tests.proxy.relay import Relay
from tests.reports import report
from tests.workers.fakes import Client, FakeEngine
from workers.server import TokenServer

BOUND = 0.6
SLACK = 0.3
SETTLE_S = 10.0
HELLO = Hello("decode-0", "decode", "fake")


def gen(stream: int, max_tokens: int, rid: str = "req-1") -> Generate:
    return Generate(stream, rid, [1, 2, 3], {"max_tokens": max_tokens})


async def started(engine: FakeEngine, bound: float = BOUND, hello: Hello = HELLO) -> TokenServer:
    server = TokenServer(engine, hello, liveness_timeout_s=bound)  # type: ignore[arg-type]
    await server.start()
    return server


async def until_aborted(engine: FakeEngine, request_id: str) -> float:
    """When (monotonic) the engine saw ``request_id`` aborted (polled every 5 ms)."""
    async with asyncio.timeout(SETTLE_S):
        while request_id not in engine.aborted:  # noqa: ASYNC110 (the fake has no event for it)
            await asyncio.sleep(0.005)
    return time.monotonic()


@pytest.mark.parametrize("mode", ["drop", "stall"])
async def test_both_ends_notice_a_relay_that_stops_forwarding(
    mode: Literal["drop", "stall"],
) -> None:
    engine = FakeEngine(step_s=0.01)
    server = await started(engine)
    relay = await Relay(server.address).start()
    client = WorkerClient(relay.address, liveness_timeout_s=BOUND)
    try:
        await client.connect(timeout_s=SETTLE_S)
        stream = client.open()
        await stream.send(gen(stream.id, 100_000))
        for _ in range(5):
            assert isinstance(await stream.next(), Tokens)
        aborted = asyncio.create_task(until_aborted(engine, "req-1"))
        cut = time.monotonic()
        relay.cut(mode)
        with pytest.raises(ConnectionLost, match="nothing received for") as info:
            async with asyncio.timeout(SETTLE_S):
                while True:
                    await stream.next()
        proxy_s = time.monotonic() - cut
        worker_s = await aborted - cut
        assert client.closed
        assert client.silent == str(info.value)
        assert proxy_s <= BOUND + SLACK, f"the proxy noticed after {proxy_s:.3f}s"
        assert worker_s <= BOUND + SLACK, f"the worker aborted after {worker_s:.3f}s"
        assert engine.aborted == ["req-1"]
        async with asyncio.timeout(SETTLE_S):
            await server.wait_idle()
            while server.connections:  # noqa: ASYNC110 (its handler's finally runs after the streams)
                await asyncio.sleep(0.01)
        print(f"{mode}: proxy noticed in {proxy_s:.3f}s, worker aborted in {worker_s:.3f}s")
    finally:
        await client.close()
        await relay.close()
        await server.shutdown(drain_timeout=0.1)


async def test_the_default_bound_is_kept() -> None:
    """The same with cluster.liveness_timeout_s at its default (2 s)."""
    engine = FakeEngine(step_s=0.01)
    server = await started(engine, DEFAULT_TIMEOUT_S)
    relay = await Relay(server.address).start()
    pool = WorkerPool(liveness_timeout_s=DEFAULT_TIMEOUT_S)
    try:
        client = await pool.get(relay.address)
        stream = client.open()
        await stream.send(gen(stream.id, 100_000))
        for _ in range(5):
            await stream.next()
        aborted = asyncio.create_task(until_aborted(engine, "req-1"))
        cut = time.monotonic()
        relay.cut("drop")
        with pytest.raises(ConnectionLost, match="nothing received for"):
            async with asyncio.timeout(SETTLE_S):
                while True:
                    await stream.next()
        proxy_s = time.monotonic() - cut
        worker_s = await aborted - cut
        assert proxy_s <= DEFAULT_TIMEOUT_S + SLACK, f"the proxy noticed after {proxy_s:.3f}s"
        assert worker_s <= DEFAULT_TIMEOUT_S + SLACK, f"the worker aborted after {worker_s:.3f}s"
        print(f"default bound: proxy noticed in {proxy_s:.3f}s, worker aborted in {worker_s:.3f}s")
        # The silent worker is not tried again at once: the next get fails fast.
        assert (pool.backing_off(relay.address) or 0.0) > 0
        start = time.monotonic()
        with pytest.raises(ConnectionLost, match="went silent"):
            await pool.get(relay.address)
        assert time.monotonic() - start < 0.1
    finally:
        await pool.close()
        await relay.close()
        await server.shutdown(drain_timeout=0.1)


async def test_an_idle_connection_stays_up_and_heartbeats_flow() -> None:
    engine = FakeEngine()
    server = await started(engine)
    relay = await Relay(server.address).start()
    client = WorkerClient(relay.address, liveness_timeout_s=BOUND)
    try:
        await client.connect(timeout_s=SETTLE_S)
        await asyncio.sleep(0.1)
        before = dict(relay.forwarded)
        await asyncio.sleep(5 * BOUND)
        assert not client.closed
        assert server.connections == 1
        # Pings and Pongs crossed the relay both ways while no request ran.
        assert relay.forwarded["up"] > before.get("up", 0)
        assert relay.forwarded["down"] > before.get("down", 0)
        stream = client.open()
        await stream.send(gen(stream.id, 3))
        got = []
        while True:
            msg = await stream.next()
            assert isinstance(msg, Tokens)
            got += msg.token_ids
            if msg.finish_reason:
                break
        assert got == [100, 101, 102]
        assert relay.accepted == 1  # the same connection all along
    finally:
        await client.close()
        await relay.close()
        await server.shutdown(drain_timeout=0.1)


async def test_a_long_stream_with_a_silent_proxy_side_stays_up() -> None:
    """Tokens flow one way only (the proxy sends nothing): the worker's Pings keep it up."""
    engine = FakeEngine(step_s=0.02)
    server = await started(engine)
    client = WorkerClient(server.address, liveness_timeout_s=BOUND)
    try:
        await client.connect(timeout_s=SETTLE_S)
        stream = client.open()
        n = int(4 * BOUND / 0.02)
        await stream.send(gen(stream.id, n))
        count = 0
        while True:
            msg = await stream.next()
            assert isinstance(msg, Tokens)
            count += len(msg.token_ids)
            if msg.finish_reason:
                break
        assert count == n
        assert engine.aborted == []
        assert not client.closed
    finally:
        await client.close()
        await server.shutdown(drain_timeout=0.1)


# -- with peers that do not speak heartbeats ---------------------------------------------


async def test_an_older_worker_refusing_ping_keeps_its_connection() -> None:
    """It answers the first Ping with a bad_frame Error: no more Pings, no deadline."""
    frames: list[bytes] = []

    async def older_worker(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(frame(HELLO))
        while data := await reader.read(65536):
            frames.append(data)
            # What a worker without Ping in its decoder answers.
            writer.write(frame(Error(-1, "bad_frame", "unknown message kind 'ping'")))
        writer.close()

    fake = await asyncio.start_server(older_worker, "127.0.0.1", 0)
    address = f"127.0.0.1:{fake.sockets[0].getsockname()[1]}"
    client = WorkerClient(address, liveness_timeout_s=BOUND)
    try:
        await client.connect(timeout_s=SETTLE_S)
        await asyncio.sleep(4 * BOUND)
        assert not client.closed
        decoder = FrameDecoder()
        decoder.feed(b"".join(frames))
        assert list(decoder) == [Ping(1)]
    finally:
        await client.close()
        fake.close()
        await fake.wait_closed()


async def test_an_older_proxy_that_never_pings_is_not_dropped() -> None:
    engine = FakeEngine()
    server = await started(engine)
    c = await Client.connect(server.address)
    try:
        assert await c.recv() == HELLO
        with pytest.raises(TimeoutError):  # the worker sends it nothing, no Ping either
            await c.recv(within_s=4 * BOUND)
        await c.send(gen(1, 2))
        assert (await c.recv()).token_ids == [100]  # type: ignore[attr-defined]
        assert (await c.recv()).token_ids == [101]  # type: ignore[attr-defined]
        assert server.connections == 1
    finally:
        await c.close()
        await server.shutdown(drain_timeout=0.1)


# -- the proxy recovers as from a dead worker ---------------------------------------------


async def collect(backend: ClusterBackend, req: GenerationRequest) -> list[TokenBatch]:
    return [b async for b in backend.generate(req)]


@pytest.fixture
async def two_decoders() -> AsyncIterator[SimpleNamespace]:
    """decode-0 behind a relay (picked first: empty), decode-1 direct (busy on paper)."""
    engines = [FakeEngine(step_s=0.01), FakeEngine(step_s=0.01)]
    servers = [
        await started(engines[0], hello=Hello("decode-0", "decode", "fake")),
        await started(engines[1], hello=Hello("decode-1", "decode", "fake")),
    ]
    relay = await Relay(servers[0].address).start()
    bus = SimpleNamespace(keys=SimpleNamespace(reports="t:reports"))  # only named in errors
    directory = Directory(bus, staleness_s=60)  # type: ignore[arg-type]
    for name, address, used in (
        ("decode-0", relay.address, 0),
        ("decode-1", servers[1].address, 5000),
    ):
        directory._reports[name] = (time.monotonic(), report(name, address=address, used=used))
    events: asyncio.Queue[Event] = asyncio.Queue()
    pool = WorkerPool(liveness_timeout_s=BOUND)
    backend = ClusterBackend(directory, pool, "current-load", "proxy:test", events)
    yield SimpleNamespace(
        backend=backend, engines=engines, relay=relay, pool=pool, events=events, servers=servers
    )
    await pool.close()
    await relay.close()
    for server in servers:
        await server.shutdown(drain_timeout=0.1)


async def test_a_silent_decode_instance_is_recovered_from_once_and_avoided(
    two_decoders: SimpleNamespace,
) -> None:
    f = two_decoders
    req = GenerationRequest("req-a", "fake", [1, 2, 3], {"max_tokens": 150})
    got: list[int] = []
    arrivals: list[float] = []
    cut = 0.0
    aborted: asyncio.Task[float] | None = None
    async with asyncio.timeout(SETTLE_S):
        async for batch in f.backend.generate(req):
            got += batch.token_ids
            arrivals.append(time.monotonic())
            if len(got) == 20:
                aborted = asyncio.create_task(until_aborted(f.engines[0], "req-a"))
                cut = time.monotonic()
                f.relay.cut("drop")
    run_events = []
    while not f.events.empty():
        run_events.append(f.events.get_nowait())
    finished = [e for e in run_events if e.event is EventKind.FINISHED]
    assert len(got) == 150  # every token once: 20 from decode-0, 130 recomputed on decode-1
    assert [e.data["recoveries"] for e in finished] == [1]
    assert finished[0].instance == "decode-1" and finished[0].detail == "length"
    assert f.engines[0].started == ["req-a"] and f.engines[1].started == ["req-a"]
    gap = max(b - a for a, b in itertools.pairwise(arrivals) if b >= cut)
    assert gap <= BOUND + SLACK, f"the stream stalled {gap:.3f}s"
    assert aborted is not None
    worker_s = await aborted - cut
    assert worker_s <= BOUND + SLACK, f"decode-0 aborted the request after {worker_s:.3f}s"
    print(f"stream stalled {gap:.3f}s, decode-0 aborted after {worker_s:.3f}s")

    # New requests go to decode-1 at once: decode-0 is not tried while it backs
    # off, and once due, tried again in the background (the relay is still cut:
    # that attempt times out), never on a request's path.
    assert f.pool.backing_off(f.relay.address) is not None
    start = time.monotonic()
    for i in range(3):
        out = await collect(
            f.backend, GenerationRequest(f"req-{i}", "fake", [4], {"max_tokens": 2})
        )
        assert sum(len(b.token_ids) for b in out) == 2
    assert time.monotonic() - start < BOUND
    await asyncio.sleep(BOUND + SLACK)  # the background attempt has timed out by now
    out = await collect(f.backend, GenerationRequest("req-3", "fake", [4], {"max_tokens": 2}))
    assert f.relay.accepted >= 2  # it was tried again
    assert f.engines[0].started == ["req-a"]
    assert f.engines[1].started == ["req-a", "req-0", "req-1", "req-2", "req-3"]

    # The partition heals: decode-0 is connected again (in the background) and
    # takes requests again.
    f.relay.heal()
    async with asyncio.timeout(SETTLE_S):
        while f.pool.backing_off(f.relay.address) is not None:
            f.backend.directory._down.clear()  # the directory's own 2 s mark-down aside
            await collect(f.backend, GenerationRequest("req-x", "fake", [4], {"max_tokens": 1}))
            await asyncio.sleep(0.05)
    f.backend.directory._down.clear()
    out = await collect(f.backend, GenerationRequest("req-4", "fake", [4], {"max_tokens": 2}))
    assert sum(len(b.token_ids) for b in out) == 2
    assert f.engines[0].started[-1] == "req-4"


async def test_every_worker_silent_at_once_is_waited_for_not_dropped() -> None:
    """The proxy's side of a box starved of CPU (issue 26; CI's chaos run at a load average
    of 7): every worker late together. Dropping them all would leave nowhere to recover
    to, so the proxy waits (star.liveness.may_drop, up to ALONE_BOUNDS bounds), and once
    they are heard again every stream goes on to its end. (The workers' own check is off
    here: a starved worker's loop is late, and excuses itself.)"""
    engines = [FakeEngine(step_s=0.01) for _ in range(2)]
    servers = [
        await started(engine, 0.0, Hello(f"decode-{i}", "decode", "fake"))
        for i, engine in enumerate(engines)
    ]
    relays = [await Relay(server.address).start() for server in servers]
    pool = WorkerPool(liveness_timeout_s=BOUND)
    try:
        clients, streams = [], []
        for i, relay in enumerate(relays):
            client = await pool.get(relay.address)
            stream = client.open()
            await stream.send(gen(stream.id, 120, rid=f"req-{i}"))
            clients.append(client)
            streams.append(stream)
        counts = [0, 0]
        for i, stream in enumerate(streams):
            while counts[i] < 5:
                msg = await stream.next()
                assert isinstance(msg, Tokens)
                counts[i] += len(msg.token_ids)
        for relay in relays:
            relay.cut("stall")
        await asyncio.sleep(2.5 * BOUND)  # past the bound, within ALONE_BOUNDS of it
        assert not any(c.closed for c in clients)
        for relay in relays:
            relay.heal()
        async with asyncio.timeout(SETTLE_S):
            for i, stream in enumerate(streams):
                while True:
                    msg = await stream.next()
                    assert isinstance(msg, Tokens)
                    counts[i] += len(msg.token_ids)
                    if msg.finish_reason is not None:
                        break
        assert counts == [120, 120]
        assert pool.backing_off(relays[0].address) is None
    finally:
        await pool.close()
        for relay in relays:
            await relay.close()
        for server in servers:
            await server.shutdown(drain_timeout=0.1)
