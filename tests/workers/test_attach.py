"""A worker holds a resumable request whose proxy went away, and another proxy attaches it.

Real TokenServer, scripted engine (tests/workers/fakes.py), raw proxy-side
connections: the exactly-once accounting is over the token ids.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from star.wire import (
    Attach,
    Attached,
    Error,
    ErrorCode,
    Generate,
    Handoff,
    Hello,
    Release,
    ResumableGenerate,
    Tokens,
    frame,
)
from tests.proxy.rawhttp import until
from tests.workers.fakes import Client, FakeEngine
from workers.protocol import PromptScores, TokenDelta
from workers.resumable import Record
from workers.server import TokenServer

HELLO = Hello(instance="decode-test", role="decode", model="fake")
GRACE_S = 0.6


@pytest.fixture
def engine() -> FakeEngine:
    return FakeEngine(step_s=0.01)


@pytest.fixture
async def server(engine: FakeEngine) -> AsyncIterator[TokenServer]:
    srv = TokenServer(engine, HELLO, "127.0.0.1", 0, orphan_grace_s=GRACE_S)
    await srv.start()
    yield srv
    await srv.shutdown(drain_timeout=0.1)


async def connect(server: TokenServer) -> Client:
    c = await Client.connect(server.address)
    assert await c.recv() == HELLO
    return c


def resumable(stream: int, rid: str, max_tokens: int, **kw: object) -> ResumableGenerate:
    return ResumableGenerate(
        stream=stream,
        request_id=rid,
        prompt_token_ids=[1, 2, 3],
        sampling={"max_tokens": max_tokens},
        context=b"ctx-" + rid.encode(),
        **kw,  # type: ignore[arg-type]
    )


async def tokens_until(c: Client, stream: int, n: int) -> list[int]:
    got: list[int] = []
    while len(got) < n:
        msg = await c.recv()
        assert isinstance(msg, Tokens) and msg.stream == stream, msg
        got += msg.token_ids
    return got


async def rest(c: Client, stream: int) -> tuple[list[int], str | None]:
    got: list[int] = []
    while True:
        msg = await c.recv()
        assert isinstance(msg, Tokens) and msg.stream == stream, msg
        got += msg.token_ids
        if msg.finish_reason is not None:
            return got, msg.finish_reason


async def test_an_orphan_decodes_on_and_another_proxy_takes_it_exactly_once(
    server: TokenServer, engine: FakeEngine
) -> None:
    first = await connect(server)
    await first.send(resumable(1, "r1", 40))
    seen = await tokens_until(first, 1, 3)
    await first.close()  # the proxy died
    await asyncio.sleep(0.15)  # it decodes on, unsent
    assert "r1" in engine.live
    second = await connect(server)
    await second.send(Attach(stream=7, request_id="r1"))
    attached = await second.recv()
    assert isinstance(attached, Attached) and attached.stream == 7
    assert attached.prompt_token_ids == [1, 2, 3] and attached.context == b"ctx-r1"
    assert attached.output_token_ids[: len(seen)] == seen
    assert len(attached.output_token_ids) > len(seen) + 3  # decoded while orphaned
    after, finish = await rest(second, 7)
    assert attached.output_token_ids + after == [100 + i for i in range(40)]  # none lost or twice
    assert finish == "length" and engine.finished == ["r1"]
    await second.close()


@pytest.mark.parametrize("reset", ["before-eof", "after-eof"])
async def test_an_orphan_whose_send_was_waiting_on_the_dead_socket_decodes_on(
    server: TokenServer, engine: FakeEngine, reset: str
) -> None:
    """A proxy that stopped reading, then died: the stream's task was blocked
    in drain() and the reset reaches it before or after the read loop's EOF
    (chaos proxy-kill-resume: such a request was attached at 520 of 600
    tokens, never ended, and its client waited out its read timeout)."""
    first = await connect(server)
    await first.send(resumable(1, "r9", 40))
    seen = await tokens_until(first, 1, 3)
    conn = server.resumable["r9"].conn
    assert conn is not None
    dead = asyncio.Event()

    async def stuck() -> None:  # the socket's buffers full, then the peer's RST
        await dead.wait()
        raise ConnectionResetError(104, "Connection reset by peer")

    conn.writer.drain = stuck  # type: ignore[method-assign]
    await asyncio.sleep(0.05)  # the stream's task waits in drain()
    if reset == "before-eof":
        dead.set()
        await asyncio.sleep(0.05)
    await first.close()
    dead.set()
    await asyncio.sleep(0.1)
    assert "r9" in engine.live  # held, decoding on
    second = await connect(server)
    await second.send(Attach(stream=2, request_id="r9"))
    attached = await second.recv()
    assert isinstance(attached, Attached) and attached.output_token_ids[:3] == seen
    assert attached.finish_reason is None
    after, finish = await rest(second, 2)
    assert attached.output_token_ids + after == [100 + i for i in range(40)]
    assert finish == "length" and engine.finished == ["r9"]
    await second.close()


async def test_a_continuation_reports_the_tokens_before_it(server: TokenServer) -> None:
    c = await connect(server)
    leg = resumable(2, "r2", 3)
    leg = ResumableGenerate(  # a continuation after 2 tokens: they end the prompt
        stream=2,
        request_id="r2",
        prompt_token_ids=[1, 2, 3, 50, 51],
        sampling={"max_tokens": 30},
        continued=2,
        context=leg.context,
    )
    await c.send(leg)
    await tokens_until(c, 2, 1)
    await c.close()
    other = await connect(server)
    await other.send(Attach(stream=1, request_id="r2"))
    attached = await other.recv()
    assert isinstance(attached, Attached)
    assert attached.prompt_token_ids == [1, 2, 3]
    assert attached.output_token_ids[:3] == [50, 51, 100]
    await other.close()


async def test_an_orphan_not_attached_is_aborted_after_the_grace(
    server: TokenServer, engine: FakeEngine
) -> None:
    c = await connect(server)
    await c.send(resumable(1, "r3", 10_000))
    await tokens_until(c, 1, 2)
    await c.close()
    await asyncio.sleep(GRACE_S / 2)
    assert "r3" in engine.live  # held
    await until(lambda: "r3" not in engine.live, wait_s=10)
    assert engine.aborted == ["r3"]  # its KV freed
    other = await connect(server)
    await other.send(Attach(stream=1, request_id="r3"))
    gone = await other.recv()
    assert isinstance(gone, Error) and gone.code == ErrorCode.UNKNOWN_REQUEST
    await other.close()


async def test_a_finished_orphan_hands_over_its_end(
    server: TokenServer, engine: FakeEngine
) -> None:
    c = await connect(server)
    await c.send(resumable(1, "r4", 8))
    await tokens_until(c, 1, 1)
    await c.close()
    await until(lambda: "r4" in engine.finished, wait_s=10)
    other = await connect(server)
    await other.send(Attach(stream=3, request_id="r4"))
    attached = await other.recv()
    assert isinstance(attached, Attached)
    assert attached.output_token_ids == [100 + i for i in range(8)]
    assert attached.finish_reason == "length"
    await other.send(Attach(stream=4, request_id="r4"))  # collected: gone
    again = await other.recv()
    assert isinstance(again, Error) and again.code == ErrorCode.UNKNOWN_REQUEST
    await other.close()


async def test_attach_moves_a_live_stream_and_its_old_proxy_is_told(
    server: TokenServer, engine: FakeEngine
) -> None:
    old = await connect(server)
    await old.send(resumable(5, "r5", 60))
    before = await tokens_until(old, 5, 2)
    new = await connect(server)
    await new.send(Attach(stream=9, request_id="r5"))
    attached = await new.recv()
    assert isinstance(attached, Attached)
    # The old proxy's frames end with Error(moved); what it got is in the Attached.
    got_old = list(before)
    while True:
        msg = await old.recv()
        if isinstance(msg, Error):
            assert msg.stream == 5 and msg.code == ErrorCode.MOVED
            break
        assert isinstance(msg, Tokens)
        got_old += msg.token_ids
    assert attached.output_token_ids == got_old
    after, _ = await rest(new, 9)
    assert got_old + after == [100 + i for i in range(60)]
    await old.close()
    await new.close()


async def test_without_a_grace_or_a_plain_generate_the_request_is_aborted_at_once(
    engine: FakeEngine,
) -> None:
    plain = TokenServer(engine, HELLO, "127.0.0.1", 0, orphan_grace_s=GRACE_S)
    off = TokenServer(engine, HELLO, "127.0.0.1", 0)  # orphan_grace_s 0
    for srv in (plain, off):
        await srv.start()
    try:
        a = await connect(plain)
        await a.send(Generate(stream=1, request_id="p1", prompt_token_ids=[1], sampling={}))
        b = await connect(off)
        await b.send(resumable(1, "p2", 10_000))
        await tokens_until(b, 1, 1)
        await a.close()
        await b.close()
        await until(lambda: not engine.live, wait_s=5)
        assert "p2" in engine.aborted
    finally:
        for srv in (plain, off):
            await srv.shutdown(drain_timeout=0.1)


async def test_a_generate_for_an_orphaned_request_replaces_it(
    server: TokenServer, engine: FakeEngine
) -> None:
    """A proxy that lost its connection continues its request (a recovery) on the same
    worker: the orphan of that request is aborted first, the new leg runs."""
    c = await connect(server)
    await c.send(resumable(1, "r6", 10_000))
    await tokens_until(c, 1, 2)
    await c.close()
    again = await connect(server)
    await again.send(resumable(2, "r6", 3))
    got, finish = await rest(again, 2)
    assert finish == "length" and len(got) == 3
    assert engine.aborted == ["r6"] and engine.finished == ["r6"]
    await again.close()


def test_a_record_keeps_the_logprobs_of_the_tokens_generated_here() -> None:
    """A continuation (2 tokens carried in) records the logprobs of its own tokens alone."""
    leg = ResumableGenerate(
        stream=1,
        request_id="r9",
        prompt_token_ids=[1, 2, 3, 50, 51],
        sampling={"max_tokens": 30, "logprobs": 1},
        continued=2,
        context=b"c",
    )
    record = Record.of(leg)
    assert record is not None
    record.add(
        TokenDelta([60, 61], logprobs=[-0.1, -0.2], top_ids=[7, 8], top_logprobs=[-1.0, -2.0])
    )
    record.add(TokenDelta([62], "length", logprobs=[-0.3], top_ids=[9], top_logprobs=[-3.0]))
    done = record.attached(4)
    assert done.output_token_ids == [50, 51, 60, 61, 62] and done.scored_from == 2
    assert done.logprobs == [-0.1, -0.2, -0.3] and done.top_ids == [7, 8, 9]
    assert done.top_logprobs == [-1.0, -2.0, -3.0] and done.finish_reason == "length"
    plain = Record.of(resumable(2, "r10", 5))
    assert plain is not None
    plain.add(TokenDelta([60]))
    assert plain.attached(1).logprobs is None  # none asked for: none kept
    with pytest.raises(ValueError, match="without logprobs"):
        record.add(TokenDelta([63]))  # a broken engine path says so


def test_a_record_keeps_the_prompt_logprobs_its_worker_computed() -> None:
    """A decode worker that prefilled the request itself computed the prompt's logprobs:
    its Attached carries them (a proxy taking the stream over echoes the real ones);
    none computed here: the field is not written (the frame keeps its bytes)."""
    leg = ResumableGenerate(
        stream=1,
        request_id="r11",
        prompt_token_ids=[1, 2, 3],
        sampling={"max_tokens": 30, "prompt_logprobs": 1},
        context=b"c",
    )
    scores = PromptScores([-0.5, -0.7], [1, 3], [2, 4], [-0.5, -0.1])
    record = Record.of(leg)
    assert record is not None
    record.add(TokenDelta([60], prompt=scores))
    record.add(TokenDelta([61]))
    assert record.attached(4).prompt == scores.to_frame(0)
    plain = Record.of(resumable(2, "r12", 5))
    assert plain is not None
    plain.add(TokenDelta([60]))
    assert b"\xa6prompt" not in frame(plain.attached(1))  # the key, as msgpack writes it


async def test_a_request_released_for_a_move_its_proxy_never_finished_is_still_found(
    server: TokenServer, engine: FakeEngine
) -> None:
    """The proxy died after the source's Handoff, before it opened the target's leg: the
    source's stream has ended and no worker runs the request. The source keeps the
    released record for the grace, and another proxy's Attach learns it must continue the
    request elsewhere (a chaos proxy-kill-resume client got 404 for 90 s without it)."""
    engine.releases = True
    first = await connect(server)
    await first.send(resumable(1, "r11", 10_000))
    seen = await tokens_until(first, 1, 3)
    await first.send(Release(stream=1, migration="m-1"))
    while not isinstance(msg := await first.recv(), Handoff):
        assert isinstance(msg, Tokens) and msg.stream == 1, msg
        seen += msg.token_ids
    await until(lambda: "r11" not in engine.live)  # the source's stream has ended
    await asyncio.sleep(0.05)
    await first.close()  # then the proxy dies, the move half done
    second = await connect(server)
    await second.send(Attach(stream=3, request_id="r11"))
    attached = await second.recv()
    assert isinstance(attached, Attached) and attached.released, attached
    assert attached.finish_reason is None and attached.output_token_ids[: len(seen)] == seen
    await asyncio.sleep(GRACE_S + 0.3)  # then it is forgotten
    await second.send(Attach(stream=4, request_id="r11"))
    gone = await second.recv()
    assert isinstance(gone, Error) and gone.code == ErrorCode.UNKNOWN_REQUEST.value
    await second.close()


async def test_a_request_that_finished_before_its_proxy_died_hands_over_its_end(
    server: TokenServer, engine: FakeEngine
) -> None:
    """The worker sent every frame, but the proxy died before its client had them all: the
    finished record is kept for the grace, so another proxy can serve the client the rest
    (a chaos proxy-kill-resume client got 404 for 90 s without it)."""
    first = await connect(server)
    await first.send(resumable(1, "r12", 5))
    got, finish = await rest(first, 1)
    assert finish == "length"
    await first.close()
    second = await connect(server)
    await second.send(Attach(stream=2, request_id="r12"))
    attached = await second.recv()
    assert isinstance(attached, Attached) and attached.finish_reason == "length"
    assert attached.output_token_ids == got == [100, 101, 102, 103, 104]
    await second.close()
