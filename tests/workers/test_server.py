"""The token protocol server over real TCP with a scripted engine."""

from __future__ import annotations

import asyncio
import struct
from collections.abc import AsyncIterator

import msgpack
import pytest

from star.wire import (
    CONNECTION_STREAM,
    SCHEMA_VERSION,
    Abort,
    Error,
    Generate,
    Hello,
    Release,
    Tokens,
    ends_stream,
)
from tests.workers.fakes import Client, FakeEngine
from workers.server import TokenServer

HELLO = Hello(instance="decode-test", role="decode", model="fake")


@pytest.fixture
def engine() -> FakeEngine:
    return FakeEngine(step_s=0.002)


@pytest.fixture
async def server(engine: FakeEngine) -> AsyncIterator[TokenServer]:
    srv = TokenServer(engine, HELLO, "127.0.0.1", 0, max_frame=4096)
    await srv.start()
    yield srv
    await srv.shutdown(drain_timeout=0.1)


@pytest.fixture
async def client(server: TokenServer) -> AsyncIterator[Client]:
    c = await Client.connect(server.address)
    assert await c.recv() == HELLO
    yield c
    await c.close()


def gen(stream: int, max_tokens: int = 3, rid: str | None = None, **sampling: object) -> Generate:
    return Generate(
        stream=stream,
        request_id=rid or f"req-{stream}",
        prompt_token_ids=[1, 2, 3],
        sampling={"max_tokens": max_tokens, **sampling},
    )


async def collect(client: Client, streams: set[int]) -> dict[int, list[Tokens | Error]]:
    """Frames per stream until every stream in ``streams`` has its final frame."""
    out: dict[int, list[Tokens | Error]] = {s: [] for s in streams}
    open_ = set(streams)
    while open_:
        msg = await client.recv()
        assert isinstance(msg, Tokens | Error), msg
        out[msg.stream].append(msg)
        if ends_stream(msg) if isinstance(msg, Error) else msg.finish_reason is not None:
            open_.discard(msg.stream)
    return out


async def test_one_stream_delivers_deltas_then_final_frame(client: Client) -> None:
    await client.send(gen(7, max_tokens=3))
    frames = (await collect(client, {7}))[7]
    assert [f.token_ids for f in frames] == [[100], [101], [102]]  # type: ignore[union-attr]
    last = frames[-1]
    assert isinstance(last, Tokens)
    assert last.finish_reason == "length"
    assert last.kv_transfer_params == {"remote": "req-7"}
    assert last.num_prompt_tokens == 3
    assert all(f.finish_reason is None for f in frames[:-1])  # type: ignore[union-attr]


async def test_streams_are_multiplexed_on_one_connection(
    client: Client, engine: FakeEngine
) -> None:
    await client.send(gen(1, 20), gen(2, 5), gen(3, 12))
    frames = await collect(client, {1, 2, 3})
    for stream, n in ((1, 20), (2, 5), (3, 12)):
        tokens = [t for f in frames[stream] for t in f.token_ids]  # type: ignore[union-attr]
        assert tokens == list(range(100, 100 + n))
    assert sorted(engine.finished) == ["req-1", "req-2", "req-3"]
    assert engine.aborted == []


async def test_streams_interleave_rather_than_run_one_after_another(client: Client) -> None:
    await client.send(gen(1, 30), gen(2, 30))
    order: list[int] = []
    done = 0
    while done < 2:
        msg = await client.recv()
        assert isinstance(msg, Tokens)
        order.append(msg.stream)
        done += msg.finish_reason is not None
    first_of_2 = order.index(2)
    assert first_of_2 < order.count(1), "stream 2 waited for stream 1 to finish"


async def test_abort_stops_the_stream_and_acknowledges(client: Client, engine: FakeEngine) -> None:
    await client.send(gen(1, 10_000), gen(2, 10))
    first = await client.recv()
    assert isinstance(first, Tokens)
    await client.send(Abort(stream=1))
    frames = await collect(client, {1, 2})
    assert frames[1][-1] == Tokens(stream=1, token_ids=[], finish_reason="abort")
    assert [t for f in frames[2] for t in f.token_ids] == list(range(100, 110))  # type: ignore[union-attr]
    await engine.wait_idle()
    assert engine.aborted == ["req-1"]
    assert engine.finished == ["req-2"]


async def test_abort_of_unknown_stream_is_ignored(client: Client) -> None:
    await client.send(Abort(stream=99), gen(1, 2))
    frames = await collect(client, {1})
    assert [t for f in frames[1] for t in f.token_ids] == [100, 101]  # type: ignore[union-attr]


async def test_disconnect_aborts_every_open_stream(server: TokenServer, engine: FakeEngine) -> None:
    c = await Client.connect(server.address)
    assert await c.recv() == HELLO
    await c.send(gen(1, 10_000), gen(2, 10_000))
    await c.recv()
    await c.close()
    await engine.wait_idle()
    assert sorted(engine.aborted) == ["req-1", "req-2"]
    async with asyncio.timeout(30):
        await server.wait_idle()
        while server.connections:  # noqa: ASYNC110 (its handler runs its finally after the streams)
            await asyncio.sleep(0.01)


@pytest.mark.parametrize(
    "body",
    [
        b"\xc1not msgpack",
        msgpack.packb([1, 2, 3]),
        msgpack.packb({"v": 99, "k": "generate"}),
        msgpack.packb({"v": SCHEMA_VERSION, "k": "nope"}),
        msgpack.packb({"v": SCHEMA_VERSION, "k": "abort"}),  # missing stream
        msgpack.packb({"v": SCHEMA_VERSION, "k": "abort", "stream": "1"}),
        msgpack.packb({"v": SCHEMA_VERSION, "k": "abort", "stream": 1, "extra": 0}),
        msgpack.packb({"v": SCHEMA_VERSION, "k": "report"}),  # a bus message, not a frame
    ],
    ids=["garbage", "not-a-map", "version", "kind", "missing", "type", "unknown-field", "bus-kind"],
)
async def test_bad_frame_gets_an_error_and_the_connection_goes_on(
    client: Client, body: bytes
) -> None:
    await client.send_raw(struct.pack(">I", len(body)) + body)
    err = await client.recv()
    assert isinstance(err, Error)
    assert (err.stream, err.code) == (CONNECTION_STREAM, "bad_frame")
    await client.send(gen(1, 2))
    frames = await collect(client, {1})
    assert [t for f in frames[1] for t in f.token_ids] == [100, 101]  # type: ignore[union-attr]


async def test_worker_only_frames_are_refused_on_their_stream(client: Client) -> None:
    await client.send(Tokens(stream=4, token_ids=[1]))
    err = await client.recv()
    assert isinstance(err, Error)
    assert (err.stream, err.code) == (4, "bad_frame")
    await client.send(HELLO)
    err = await client.recv()
    assert isinstance(err, Error)
    assert (err.stream, err.code) == (CONNECTION_STREAM, "bad_frame")


async def test_oversized_frame_closes_the_connection(client: Client, server: TokenServer) -> None:
    await client.send(gen(1, 10_000))
    await client.recv()
    await client.send_raw(struct.pack(">I", 1 << 20) + b"x" * 10)
    while True:
        msg = await client.recv()
        if isinstance(msg, Error):
            break
    assert (msg.stream, msg.code) == (CONNECTION_STREAM, "frame_too_large")
    with pytest.raises(EOFError):
        while True:
            await client.recv()
    async with asyncio.timeout(30):
        await server.wait_idle()


async def test_duplicate_stream_id_is_refused(client: Client) -> None:
    await client.send(gen(1, 5), gen(1, 5, rid="other"))
    frames = await collect(client, {1})
    errors = [f for f in frames[1] if isinstance(f, Error)]
    assert [e.code for e in errors] == ["duplicate_stream"]
    # The first request is unaffected.
    tokens = [t for f in frames[1] if isinstance(f, Tokens) for t in f.token_ids]
    assert tokens == list(range(100, 105))


async def test_engine_error_becomes_an_error_frame(client: Client) -> None:
    await client.send(gen(1, 5, fail=2), gen(2, 3))
    frames = await collect(client, {1, 2})
    assert [f.token_ids for f in frames[1][:-1]] == [[100], [101]]  # type: ignore[union-attr]
    err = frames[1][-1]
    assert isinstance(err, Error)
    assert err.code == "bad_request"
    assert "req-1" in err.message
    assert frames[2][-1].finish_reason == "length"  # type: ignore[union-attr]


async def test_release_is_unsupported_and_the_stream_goes_on(client: Client) -> None:
    await client.send(gen(1, 50))
    await client.recv()
    await client.send(Release(stream=1, migration="m-1"))
    frames = await collect(client, {1})
    errors = [f for f in frames[1] if isinstance(f, Error)]
    assert [(e.stream, e.code) for e in errors] == [(1, "unsupported")]
    assert frames[1][-1].finish_reason == "length"  # type: ignore[union-attr]


async def test_release_of_unknown_stream(client: Client) -> None:
    await client.send(Release(stream=5, migration="m-1"))
    err = await client.recv()
    assert isinstance(err, Error)
    assert (err.stream, err.code) == (5, "unknown_stream")


async def test_shutdown_drains_then_aborts(server: TokenServer, engine: FakeEngine) -> None:
    c = await Client.connect(server.address)
    assert await c.recv() == HELLO
    await c.send(gen(1, 3), gen(2, 10_000))
    await c.recv()
    await server.shutdown(drain_timeout=3.0)  # req-1 needs ~10 ms, req-2 over 20 s
    await engine.wait_idle()
    assert engine.finished == ["req-1"]
    assert engine.aborted == ["req-2"]
    await c.close()


async def test_no_new_streams_while_draining(server: TokenServer, client: Client) -> None:
    await client.send(gen(1, 10_000))
    await client.recv()
    drain = asyncio.create_task(server.shutdown(drain_timeout=3.0))  # req-1 needs over 20 s
    await asyncio.sleep(0.05)
    await client.send(gen(2, 3))
    while True:
        msg = await client.recv()
        if msg.stream == 2:  # type: ignore[attr-defined]
            break
    assert isinstance(msg, Error)
    assert msg.code == "shutting_down"
    await drain
