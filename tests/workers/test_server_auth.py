"""The token protocol's authentication over real TCP: a worker's TokenServer with a
scripted engine, the proxy's WorkerClient, and raw peers that misbehave."""

from __future__ import annotations

import asyncio
import warnings
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest
from structlog.testing import capture_logs

from proxy.upstream import AuthFailed, WorkerClient
from star.handshake import (
    NONCE_BYTES,
    Channel,
    ProxyHandshake,
    WorkerHandshake,
    proof,
    secret_key,
)
from star.wire import (
    Accept,
    Answer,
    Challenge,
    FrameDecoder,
    Generate,
    Hello,
    Message,
    Tokens,
    decode,
    frame,
)
from tests.workers.fakes import Client, FakeEngine
from workers.server import InsecureBind, TokenServer, check_bind

HELLO = Hello(instance="decode-secret", role="decode", model="/models/private-name")
SECRET = "0123456789abcdef-cluster"
WRONG = "0123456789abcdef-clustex"


@pytest.fixture
def engine() -> FakeEngine:
    return FakeEngine(step_s=0.001)


@pytest.fixture
async def server(engine: FakeEngine) -> AsyncIterator[TokenServer]:
    srv = TokenServer(engine, HELLO, "127.0.0.1", 0, secret=SECRET, handshake_timeout_s=0.5)
    await srv.start()
    yield srv
    await srv.shutdown(drain_timeout=0.1)


async def everything_until_closed(client: Client, within_s: float = 10.0) -> bytes:
    """Every byte the worker sends until it closes the connection."""
    out = bytearray()
    async with asyncio.timeout(within_s):
        while data := await client.reader.read(65536):
            out += data
    return bytes(out)


async def test_the_proxy_with_the_secret_gets_hello_and_streams(server: TokenServer) -> None:
    client = WorkerClient(server.address, SECRET)
    try:
        assert await client.connect() == HELLO
        stream = client.open()
        await stream.send(Generate(stream.id, "r1", [1, 2], {"max_tokens": 2}))
        frames = [await stream.next(), await stream.next()]
    finally:
        await client.close()
    assert [f.token_ids for f in frames if isinstance(f, Tokens)] == [[100], [101]]
    last = frames[-1]
    assert isinstance(last, Tokens) and last.kv_transfer_params == {"remote": "r1"}
    assert server.refused == 0


async def test_a_proxy_with_the_wrong_secret_learns_nothing(server: TokenServer) -> None:
    with capture_logs() as logs:
        raw = await Client.connect(server.address)
        challenge = await raw.recv()
        assert isinstance(challenge, Challenge)
        await raw.send(ProxyHandshake(secret_key(WRONG)).on_challenge(challenge))
        rest = await everything_until_closed(raw)
        await raw.close()
    assert rest == b""  # no Accept, no Hello, no Error: nothing
    assert server.refused == 1
    assert [x["reason"] for x in logs if x["event"] == "peer_refused"] == ["bad_proof"]


async def test_a_request_right_behind_a_wrong_answer_never_reaches_the_engine(
    server: TokenServer, engine: FakeEngine
) -> None:
    raw = await Client.connect(server.address)
    challenge = await raw.recv()
    assert isinstance(challenge, Challenge)
    answer = ProxyHandshake(secret_key(WRONG)).on_challenge(challenge)
    await raw.send(answer, Generate(1, "sneaky", [1], {"max_tokens": 1}))
    assert await everything_until_closed(raw) == b""
    await raw.close()
    assert server.refused == 1 and engine.started == []


async def test_the_client_reports_a_refusal_as_auth_failed(server: TokenServer) -> None:
    client = WorkerClient(server.address, WRONG)
    with pytest.raises(AuthFailed, match=r"refused this proxy: is cluster\.secret the same"):
        await client.connect()
    assert client.closed
    assert server.refused == 1  # counted before the socket closed


async def test_a_proxy_without_a_secret_is_told_to_set_one(server: TokenServer) -> None:
    client = WorkerClient(server.address)
    with pytest.raises(AuthFailed, match=r"requires authentication: set cluster.secret"):
        await client.connect()


async def test_a_replayed_answer_is_refused(server: TokenServer) -> None:
    first = await Client.connect(server.address)
    challenge = await first.recv()
    assert isinstance(challenge, Challenge)
    shake = ProxyHandshake(secret_key(SECRET), server.address)
    recorded = shake.on_challenge(challenge)
    await first.send(recorded)
    accept = await first.recv()
    assert isinstance(accept, Accept)
    shake.on_accept(accept)
    sealed = await first.recv_raw()  # the Hello, sealed under this connection's key
    assert decode(Channel(shake.session, "proxy").open(sealed)) == HELLO
    await first.close()

    replay = await Client.connect(server.address)
    assert isinstance(await replay.recv(), Challenge)
    await replay.send(recorded)
    assert await everything_until_closed(replay) == b""
    await replay.close()
    assert server.refused == 1


Peer = Callable[[Client], Awaitable[None]]


async def send_garbage(c: Client) -> None:
    await c.send_raw(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")  # length prefix far over the limit


async def send_undecodable(c: Client) -> None:
    await c.send_raw(b"\x00\x00\x00\x03abc")


async def send_hello(c: Client) -> None:
    await c.send(HELLO)


async def send_generate(c: Client) -> None:
    await c.send(Generate(1, "r", [1], {"max_tokens": 1}))


async def send_nothing(c: Client) -> None:
    pass  # the handshake times out (0.5 s here)


async def close_at_once(c: Client) -> None:
    c.writer.write_eof()


async def answer_with_short_nonce(c: Client) -> None:
    await c.send(Answer(b"\0" * 32, b"\1" * (NONCE_BYTES - 1)))


@pytest.mark.parametrize(
    ("peer", "reason"),
    [
        (send_garbage, "frame_too_large"),
        (send_undecodable, "bad_frame"),
        (send_hello, "unexpected_frame"),
        (send_generate, "unexpected_frame"),
        (send_nothing, "timeout"),
        (close_at_once, "closed"),
        (answer_with_short_nonce, "bad_nonce"),
    ],
)
async def test_a_peer_that_fails_gets_only_the_challenge_and_is_counted(
    server: TokenServer,
    engine: FakeEngine,
    peer: Peer,
    reason: str,
) -> None:
    with capture_logs() as logs:
        raw = await Client.connect(server.address)
        assert isinstance(await raw.recv(), Challenge)
        await peer(raw)
        assert await everything_until_closed(raw) == b""
        await raw.close()
    assert server.refused == 1 and engine.started == []
    (line,) = [x for x in logs if x["event"] == "peer_refused"]
    assert line["reason"] == reason
    assert line["peer"].startswith("127.0.0.1:") and line["log_level"] == "warning"


async def test_the_proxy_never_sends_a_request_to_an_impostor() -> None:
    """A fake worker with another secret: the connect fails before any request."""
    received = bytearray()
    done = asyncio.Event()

    async def impostor(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        shake = WorkerHandshake(secret_key(WRONG))
        writer.write(frame(shake.challenge()))
        data = await reader.read(4096)
        received.extend(data)
        # It cannot check the answer; it claims success and says Hello.
        (answer,) = _frames(data)
        assert isinstance(answer, Answer)
        writer.write(frame(Accept(_worker_proof(WRONG, shake.nonce, answer.nonce))))
        writer.write(frame(HELLO))
        while data := await reader.read(4096):
            received.extend(data)
        done.set()
        writer.close()

    srv = await asyncio.start_server(impostor, "127.0.0.1", 0)
    address = f"127.0.0.1:{srv.sockets[0].getsockname()[1]}"
    client = WorkerClient(address, SECRET)
    with pytest.raises(AuthFailed, match=r"failed authentication \(bad_proof\)"):
        await client.connect()
    async with asyncio.timeout(10):
        await done.wait()
    srv.close()
    await srv.wait_closed()
    msgs = _frames(bytes(received))
    assert [type(m) for m in msgs] == [Answer]  # the answer, then nothing: no Generate


async def test_a_relay_without_the_secret_gets_the_handshake_refused(
    server: TokenServer,
) -> None:
    """A proxy sent to a relay (a forged report naming the relay's address) that forwards
    every byte to the real worker: the proxy proves the secret for the relay's address,
    the worker checks it for its own, and refuses; no Hello, no request."""
    to_worker = bytearray()

    async def relay(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        host, port = server.address.rsplit(":", 1)
        up_reader, up_writer = await asyncio.open_connection(host, int(port))

        async def pump(
            src: asyncio.StreamReader, dst: asyncio.StreamWriter, log: bytearray | None
        ) -> None:
            while data := await src.read(4096):
                if log is not None:
                    log.extend(data)
                dst.write(data)
                await dst.drain()
            dst.close()

        await asyncio.gather(
            pump(reader, up_writer, to_worker),
            pump(up_reader, writer, None),
            return_exceptions=True,
        )

    srv = await asyncio.start_server(relay, "127.0.0.1", 0)
    address = f"127.0.0.1:{srv.sockets[0].getsockname()[1]}"
    client = WorkerClient(address, SECRET)
    try:
        with pytest.raises(AuthFailed, match="refused this proxy"):
            await client.connect()
    finally:
        await client.close()
        srv.close()
        await srv.wait_closed()
    assert [type(m) for m in _frames(bytes(to_worker))] == [Answer]  # nothing after it
    assert server.refused == 1


async def test_a_frame_altered_on_the_way_closes_the_connection(
    server: TokenServer, engine: FakeEngine
) -> None:
    """Someone on the path flips one bit of a sealed Generate: the worker refuses it and
    closes the connection, running nothing; the same frame unaltered would have run."""
    shake = ProxyHandshake(secret_key(SECRET), server.address)
    raw = await Client.connect(server.address)
    await raw.send(shake.on_challenge(await raw.recv()))
    shake.on_accept(await raw.recv())
    channel = Channel(shake.session, "proxy")
    assert decode(Channel(shake.session, "proxy").open(await raw.recv_raw())) == HELLO
    sealed = bytearray(frame(Generate(1, "r1", [1, 2], {"max_tokens": 2}), channel.seal))
    sealed[-20] ^= 1
    raw.writer.write(bytes(sealed))
    assert await everything_until_closed(raw) == b""
    assert engine.started == []
    await raw.close()


def _frames(data: bytes) -> list[Message]:
    dec = FrameDecoder()
    dec.feed(data)
    return list(dec)


def _worker_proof(secret: str, worker_nonce: bytes, proxy_nonce: bytes) -> bytes:
    return proof(secret_key(secret), b"star-token-protocol/2 worker\0", worker_nonce, proxy_nonce)


async def test_a_secret_proxy_refuses_a_worker_without_one(engine: FakeEngine) -> None:
    open_worker = TokenServer(engine, HELLO, "127.0.0.1", 0)
    await open_worker.start()
    try:
        client = WorkerClient(open_worker.address, SECRET)
        with pytest.raises(AuthFailed, match="no_challenge"):
            await client.connect()
    finally:
        await open_worker.shutdown(drain_timeout=0.1)


async def test_without_a_secret_on_either_side_hello_comes_first(engine: FakeEngine) -> None:
    open_worker = TokenServer(engine, HELLO, "127.0.0.1", 0)
    await open_worker.start()
    try:
        client = WorkerClient(open_worker.address)
        assert await client.connect() == HELLO
        await client.close()
    finally:
        await open_worker.shutdown(drain_timeout=0.1)


async def test_a_draining_worker_tells_an_unproven_peer_nothing(server: TokenServer) -> None:
    server.draining = True
    raw = await Client.connect(server.address)
    assert await everything_until_closed(raw) == b""
    await raw.close()


@pytest.mark.parametrize("host", ["0.0.0.0", "10.1.2.3", "::", "worker-a.example"])
def test_a_worker_beyond_loopback_needs_a_secret(host: str, engine: FakeEngine) -> None:
    with pytest.raises(InsecureBind, match=r"set cluster.secret \(STAR_CLUSTER_SECRET\)"):
        check_bind(host, "")
    with pytest.raises(InsecureBind):
        TokenServer(engine, HELLO, host, 0)
    check_bind(host, SECRET)
    check_bind("127.0.0.1", "")


def test_a_worker_service_beyond_loopback_without_a_secret_does_not_start() -> None:
    from star.settings import SettingsError, load_settings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # vLLM's import-time warnings
        from workers.service import WorkerService

    settings = load_settings(env={}, overrides={"worker.host": "0.0.0.0", "worker.port": 0})
    with pytest.raises(SettingsError) as err:
        WorkerService(settings)
    assert str(err.value).count("\n") == 0
    assert "worker.host=0.0.0.0" in str(err.value) and "cluster.secret" in str(err.value)
