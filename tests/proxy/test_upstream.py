"""WorkerClient.connect against fake workers that never send a proper Hello.

Each fake accepts, misbehaves (garbage, a half-close, silence, a frame that is
not a Hello), then reads until the client's side of the socket is closed. The
connect must fail with an error naming the worker, and the fake must see EOF:
a client that kept its socket open would leak one per reconnect attempt.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

import pytest

from proxy.upstream import ConnectionLost, Stream, WorkerClient
from star.wire import Error, Hello, Tokens, frame

# Bounds a wait for something that must happen, on a loaded box.
SETTLE_S = 10.0

Behaviour = Callable[[asyncio.StreamWriter], Awaitable[None]]


@dataclass
class FakeWorker:
    behaviour: Behaviour
    address: str = ""
    saw_eof: asyncio.Event = field(default_factory=asyncio.Event)

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await self.behaviour(writer)
            # Whatever the client sends, then EOF once it closes its socket.
            while await reader.read(4096):
                pass
            self.saw_eof.set()
        finally:
            writer.close()


@pytest.fixture
async def fake_worker() -> AsyncIterator[Callable[[Behaviour], Awaitable[FakeWorker]]]:
    servers: list[asyncio.Server] = []

    async def start(behaviour: Behaviour) -> FakeWorker:
        fake = FakeWorker(behaviour)
        server = await asyncio.start_server(fake.handle, "127.0.0.1", 0)
        servers.append(server)
        fake.address = f"127.0.0.1:{server.sockets[0].getsockname()[1]}"
        return fake

    yield start
    for server in servers:
        server.close()
        await server.wait_closed()


async def send_garbage(writer: asyncio.StreamWriter) -> None:
    writer.write(b"HTTP/1.1 400 Bad Request\r\n\r\n")  # a length prefix far over the frame limit
    await writer.drain()


async def send_undecodable_frame(writer: asyncio.StreamWriter) -> None:
    writer.write(b"\x00\x00\x00\x03abc")
    await writer.drain()


async def send_error_frame(writer: asyncio.StreamWriter) -> None:
    writer.write(frame(Error(-1, "shutting_down", "the worker is shutting down")))
    await writer.drain()


async def half_close(writer: asyncio.StreamWriter) -> None:
    writer.write_eof()


async def say_nothing(writer: asyncio.StreamWriter) -> None:
    pass


async def assert_client_closed(fake: FakeWorker) -> None:
    async with asyncio.timeout(SETTLE_S):
        await fake.saw_eof.wait()


@pytest.mark.parametrize(
    ("behaviour", "message"),
    [
        (send_garbage, "bad frame instead of Hello"),
        (send_undecodable_frame, "bad frame instead of Hello"),
        (send_error_frame, "did not start with Hello (got error)"),
        (half_close, "closed before Hello"),
    ],
)
async def test_a_failed_hello_closes_the_socket(
    fake_worker: Callable[[Behaviour], Awaitable[FakeWorker]], behaviour: Behaviour, message: str
) -> None:
    fake = await fake_worker(behaviour)
    client = WorkerClient(fake.address)
    with pytest.raises(ConnectionLost, match=re.escape(message)) as info:
        await client.connect(timeout_s=SETTLE_S)
    assert fake.address in str(info.value)
    assert client.closed
    await assert_client_closed(fake)


async def test_no_hello_in_time_closes_the_socket(
    fake_worker: Callable[[Behaviour], Awaitable[FakeWorker]],
) -> None:
    fake = await fake_worker(say_nothing)
    client = WorkerClient(fake.address)
    with pytest.raises(
        TimeoutError, match=re.escape(f"worker {fake.address} sent no Hello within 0.2s")
    ):
        await client.connect(timeout_s=0.2)
    assert client.closed
    await assert_client_closed(fake)


async def test_a_cancelled_connect_closes_the_socket(
    fake_worker: Callable[[Behaviour], Awaitable[FakeWorker]],
) -> None:
    accepted = asyncio.Event()

    async def accept_and_wait(writer: asyncio.StreamWriter) -> None:
        accepted.set()

    fake = await fake_worker(accept_and_wait)
    client = WorkerClient(fake.address)
    task = asyncio.create_task(client.connect(timeout_s=SETTLE_S))
    async with asyncio.timeout(SETTLE_S):
        await accepted.wait()
    task.cancel()
    done, _ = await asyncio.wait({task}, timeout=SETTLE_S)
    assert done and task.cancelled()
    await assert_client_closed(fake)


async def test_a_hello_connects(fake_worker: Callable[[Behaviour], Awaitable[FakeWorker]]) -> None:
    async def hello(writer: asyncio.StreamWriter) -> None:
        writer.write(frame(Hello("decode-0", "decode", "tiny")))
        await writer.drain()

    fake = await fake_worker(hello)
    client = WorkerClient(fake.address)
    try:
        assert await client.connect(timeout_s=SETTLE_S) == Hello("decode-0", "decode", "tiny")
        assert not client.closed
        assert not fake.saw_eof.is_set()
    finally:
        await client.close()
    await assert_client_closed(fake)


def test_a_send_on_a_transport_closed_under_it_is_a_lost_connection() -> None:
    """The worker's RST can close the transport before the reader task sees EOF:
    a send then is a ConnectionLost (recovered), not uvloop's RuntimeError
    ("the handler is closed"), which failed the request (chaos row
    target-kill-mid-pull). Run on uvloop, the proxy's loop."""
    import uvloop

    async def hello(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(frame(Hello("decode-0", "decode", "tiny")))
        await writer.drain()
        await reader.read()
        writer.close()

    async def scenario() -> None:
        server = await asyncio.start_server(hello, "127.0.0.1", 0)
        client = WorkerClient(f"127.0.0.1:{server.sockets[0].getsockname()[1]}")
        try:
            await client.connect(timeout_s=SETTLE_S)
            assert client._writer is not None
            client._writer.transport.abort()  # closed under the client; `closed` not yet set
            assert not client.closed
            with pytest.raises(ConnectionLost, match="is closed"):
                await client.send(Error(1, "x", "y"))
        finally:
            await client.close()
            server.close()
            await server.wait_closed()

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(scenario())


async def test_a_backlog_on_a_stream_lets_the_event_loop_run() -> None:
    """Frames queued faster than they are relayed (a burst after the proxy was starved, a
    worker outpacing the relay) are handed out a few at a time between event-loop turns:
    before, the relay took the whole backlog in one turn, and the loop answered no
    worker's Ping meanwhile (the worker dropped the proxy as silent, issue 26)."""
    client = WorkerClient("127.0.0.1:1")
    stream = client.open()
    backlog = 1000
    for i in range(backlog):
        stream.put(Tokens(stream.id, [i]))
    taken = 0

    async def relay() -> None:
        nonlocal taken
        for _ in range(backlog):
            await stream.next()
            taken += 1

    task = asyncio.create_task(relay())
    await asyncio.sleep(0)  # the relay's first turn, then this one's
    assert 0 < taken <= Stream.YIELD_EVERY
    await asyncio.wait_for(task, 5)
    assert taken == backlog


async def test_the_pool_replaces_a_connection_its_worker_closed_before_the_reader_saw_it() -> None:
    """A worker that dropped this proxy (as silent, its loop late) closes the transport
    before the reader task has set ``closed``: the pool connects again instead of handing
    out the dead connection, so a recovery reaches that worker (before, a chaos run's
    unfaulted row lost a stream when both decode workers dropped a starved proxy at once)."""
    from proxy.upstream import WorkerPool

    async def hello(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(frame(Hello("decode-0", "decode", "tiny")))
        await writer.drain()
        await reader.read()
        writer.close()

    server = await asyncio.start_server(hello, "127.0.0.1", 0)
    address = f"127.0.0.1:{server.sockets[0].getsockname()[1]}"
    pool = WorkerPool(liveness_timeout_s=0)
    try:
        first = await pool.get(address)
        assert await pool.get(address) is first
        assert first._writer is not None
        first._writer.transport.abort()  # closed under the client; `closed` not yet set
        assert not first.closed and not first.usable
        second = await pool.get(address)
        assert second is not first and second.usable
        await second.open().send(Error(1, "x", "y"))  # reaches the worker: no ConnectionLost
    finally:
        await pool.close()
        server.close()
        await server.wait_closed()
