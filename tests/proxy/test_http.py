"""The HTTP layer over raw sockets: limits, errors, keep-alive, disconnects, drain."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest

from proxy.http import HttpError, HttpServer, Request, Response, StreamingResponse
from star.settings import ProxySettings
from tests.proxy.rawhttp import exchange, parse_responses, request_bytes, until

Handler = Callable[[Request], Awaitable[Response | StreamingResponse]]


async def echo(request: Request) -> Response:
    return Response.json(
        {"path": request.path, "query": request.query, "body": request.body.decode()}
    )


@pytest.fixture
async def serve() -> AsyncIterator[Callable[..., Awaitable[HttpServer]]]:
    servers: list[HttpServer] = []

    async def start(
        handler: Handler = echo, idle_timeout_s: float = 75.0, **kw: object
    ) -> HttpServer:
        settings = ProxySettings(host="127.0.0.1", port=0, **kw)  # type: ignore[arg-type]
        seen: list[tuple[str, int]] = []
        server = HttpServer(
            handler,
            settings,
            idle_timeout_s=idle_timeout_s,
            observer=lambda p, s: seen.append((p, s)),
        )
        server.seen = seen  # type: ignore[attr-defined]
        await server.start()
        servers.append(server)
        return server

    yield start
    for s in servers:
        await s.shutdown(timeout_s=1.0)


def assert_openai_error(resp: object, status: int) -> dict[str, object]:
    assert resp.status == status  # type: ignore[attr-defined]
    body = resp.json()  # type: ignore[attr-defined]
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["message"]
    return body["error"]  # type: ignore[no-any-return]


async def test_keep_alive_and_pipelining_answer_in_order(serve) -> None:
    server = await serve()
    data = b"".join(request_bytes("POST", f"/r{i}?q={i}", f"body{i}".encode()) for i in range(5))
    data += request_bytes("GET", "/last", headers={"connection": "close"})
    responses = parse_responses(await exchange(server.port, data))
    assert [r.status for r in responses] == [200] * 6
    assert [r.json()["path"] for r in responses] == [f"/r{i}" for i in range(5)] + ["/last"]
    assert [r.json()["body"] for r in responses[:5]] == [f"body{i}" for i in range(5)]
    assert responses[2].json()["query"] == "q=2"


@pytest.mark.parametrize(
    "raw",
    [
        b"GARBAGE\r\n\r\n",
        b"GET / HTTP/1.1\r\nno-colon-here\r\n\r\n",
        b"GET / HTTP/1.1\r\nhost: a\r\ncontent-length: nope\r\n\r\n",
        b"GET / HTTP/1.1\r\nhost : a\r\n\r\n",
        b"GET / HTTP/1.1\r\n\r\n",  # HTTP/1.1 requires Host
    ],
)
async def test_malformed_request_gets_400_in_openai_format(serve, raw: bytes) -> None:
    server = await serve()
    (resp,) = parse_responses(await exchange(server.port, raw))
    err = assert_openai_error(resp, 400)
    assert err["type"] == "invalid_request_error"
    assert resp.headers["connection"] == "close"


async def test_huge_head_gets_431(serve) -> None:
    server = await serve(max_header_bytes=1024)
    raw = b"GET / HTTP/1.1\r\nhost: a\r\nx-big: " + b"a" * 4000 + b"\r\n\r\n"
    (resp,) = parse_responses(await exchange(server.port, raw))
    assert_openai_error(resp, 431)


async def test_body_over_content_length_limit_gets_413_before_reading(serve) -> None:
    calls: list[Request] = []

    async def handler(request: Request) -> Response:
        calls.append(request)
        return Response.json({})

    server = await serve(handler, max_body_bytes=100)
    # Announce a large body but send none: the answer must not wait for it.
    raw = b"POST /v1/completions HTTP/1.1\r\nhost: a\r\ncontent-length: 1000000\r\n\r\n"
    (resp,) = parse_responses(await exchange(server.port, raw))
    err = assert_openai_error(resp, 413)
    assert err["code"] == "request_too_large"
    assert calls == []


async def test_chunked_body_over_limit_gets_413(serve) -> None:
    server = await serve(max_body_bytes=100)
    chunk = b"40\r\n" + b"x" * 64 + b"\r\n"
    raw = (
        b"POST / HTTP/1.1\r\nhost: a\r\ntransfer-encoding: chunked\r\n\r\n"
        + chunk * 3
        + b"0\r\n\r\n"
    )
    (resp,) = parse_responses(await exchange(server.port, raw))
    assert_openai_error(resp, 413)


async def test_chunked_body_under_limit_is_assembled(serve) -> None:
    server = await serve(max_body_bytes=100)
    raw = b"POST /c HTTP/1.1\r\nhost: a\r\nconnection: close\r\ntransfer-encoding: chunked\r\n\r\n"
    raw += b"3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n"
    (resp,) = parse_responses(await exchange(server.port, raw))
    assert resp.json()["body"] == "abcde"


async def test_handler_errors_become_openai_errors(serve) -> None:
    async def handler(request: Request) -> Response:
        if request.path == "/teapot":
            raise HttpError(418, "short and stout", param="spout", code="teapot")
        raise RuntimeError("bug")

    server = await serve(handler)
    data = request_bytes("GET", "/teapot") + request_bytes(
        "GET", "/bug", headers={"connection": "close"}
    )
    r1, r2 = parse_responses(await exchange(server.port, data))
    err = assert_openai_error(r1, 418)
    assert (err["param"], err["code"]) == ("spout", "teapot")
    err = assert_openai_error(r2, 500)
    assert err["type"] == "server_error"
    assert "bug" not in str(err["message"])  # internals stay in the log


async def test_streaming_response_is_chunked_and_keeps_connection(serve) -> None:
    async def handler(request: Request) -> StreamingResponse:
        async def body() -> AsyncIterator[bytes]:
            for i in range(3):
                yield f"data: {i}\n\n".encode()
                await asyncio.sleep(0)

        return StreamingResponse(body())

    server = await serve(handler)
    data = request_bytes("GET", "/a") + request_bytes("GET", "/b", headers={"connection": "close"})
    r1, r2 = parse_responses(await exchange(server.port, data))
    for r in (r1, r2):
        assert r.headers["transfer-encoding"] == "chunked"
        assert r.headers["content-type"].startswith("text/event-stream")
        assert r.body == b"data: 0\n\ndata: 1\n\ndata: 2\n\n"


async def test_client_disconnect_cancels_handler_and_closes_body(serve) -> None:
    started = asyncio.Event()
    state: dict[str, str] = {}

    async def handler(request: Request) -> StreamingResponse:
        async def body() -> AsyncIterator[bytes]:
            try:
                yield b"data: first\n\n"
                started.set()
                await asyncio.Event().wait()  # a backend that has nothing more yet
            except asyncio.CancelledError as exc:
                state["outcome"] = f"cancelled: {exc.args[0] if exc.args else ''}"
                raise
            finally:
                state.setdefault("outcome", "closed")

        return StreamingResponse(body())

    server = await serve(handler)
    _, writer = await asyncio.open_connection("127.0.0.1", server.port)
    writer.write(request_bytes("GET", "/s"))
    await started.wait()
    assert server.active == 1
    writer.close()
    await writer.wait_closed()
    await until(lambda: server.active == 0)
    assert state["outcome"] == "cancelled: client disconnected"


async def test_too_many_concurrent_requests_get_429_but_health_does_not(serve) -> None:
    gate = asyncio.Event()

    async def handler(request: Request) -> Response:
        if request.path == "/slow":
            await gate.wait()
        return Response.json({"ok": True})

    server = await serve(handler, max_streams=2)
    slow_req = request_bytes("GET", "/slow", headers={"connection": "close"})
    slow = [asyncio.create_task(exchange(server.port, slow_req)) for _ in range(2)]
    await until(lambda: server.active >= 2)
    data = request_bytes("GET", "/slow") + request_bytes(
        "GET", "/health", headers={"connection": "close"}
    )
    r429, health = parse_responses(await exchange(server.port, data))
    err = assert_openai_error(r429, 429)
    assert err["type"] == "rate_limit_exceeded"
    assert r429.headers["retry-after"] == "1"
    assert health.status == 200
    gate.set()
    for task in slow:
        (resp,) = parse_responses(await task)
        assert resp.status == 200
    assert server.active == 0
    assert ("/slow", 429) in server.seen  # type: ignore[attr-defined]


async def test_shutdown_drains_in_flight_then_refuses(serve) -> None:
    gate = asyncio.Event()

    async def handler(request: Request) -> Response:
        await gate.wait()
        return Response.json({"done": True})

    server = await serve(handler)
    port = server.port
    idle_reader, idle_writer = await asyncio.open_connection("127.0.0.1", port)
    busy = asyncio.create_task(exchange(port, request_bytes("GET", "/x")))
    await until(lambda: server.active >= 1)
    shutdown = asyncio.create_task(server.shutdown(timeout_s=120))  # only the gate ends it
    await asyncio.sleep(0.05)
    assert await idle_reader.read() == b""  # idle keep-alive connection closed at once
    assert not shutdown.done()
    gate.set()
    (resp,) = parse_responses(await busy)
    assert resp.status == 200 and resp.json() == {"done": True}
    assert resp.headers["connection"] == "close"
    await shutdown
    idle_writer.close()
    with pytest.raises(OSError):
        await asyncio.open_connection("127.0.0.1", port)


async def test_shutdown_cancels_after_drain_timeout(serve) -> None:
    state: dict[str, object] = {}

    async def handler(request: Request) -> Response:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError as exc:
            state["msg"] = exc.args[0] if exc.args else None
            raise
        raise AssertionError("unreachable")

    server = await serve(handler)
    busy = asyncio.create_task(exchange(server.port, request_bytes("GET", "/x")))
    await until(lambda: server.active >= 1)
    async with asyncio.timeout(30):
        await server.shutdown(timeout_s=0.1)
    assert state["msg"] == "server shutdown"
    (resp,) = parse_responses(await busy)  # nothing was sent yet: a clean 503
    assert_openai_error(resp, 503)
    assert resp.headers["connection"] == "close"


async def test_shutdown_cuts_a_stream_that_does_not_end(serve) -> None:
    async def handler(request: Request) -> StreamingResponse:
        async def body() -> AsyncIterator[bytes]:
            yield b"data: 1\n\n"
            sent.set()  # resumed: the first chunk was handed to the transport
            await asyncio.Event().wait()
            yield b"never"

        return StreamingResponse(body())

    sent = asyncio.Event()
    server = await serve(handler)
    busy = asyncio.create_task(exchange(server.port, request_bytes("GET", "/x")))
    async with asyncio.timeout(30):
        await sent.wait()
    async with asyncio.timeout(30):
        await server.shutdown(timeout_s=0.1)
    data = await busy
    assert data.startswith(b"HTTP/1.1 200") and b"data: 1" in data
    assert not data.endswith(b"0\r\n\r\n")  # cut, not a clean end of the chunked body


async def test_expect_100_continue_gets_an_interim_response(serve) -> None:
    server = await serve()
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    writer.write(
        b"POST /e HTTP/1.1\r\nhost: a\r\ncontent-length: 3\r\nexpect: 100-continue\r\n"
        b"connection: close\r\n\r\n"
    )
    async with asyncio.timeout(30):
        interim = await reader.readuntil(b"\r\n\r\n")
    assert interim.startswith(b"HTTP/1.1 100")
    writer.write(b"abc")
    async with asyncio.timeout(30):
        (resp,) = parse_responses(await reader.read())
    assert resp.json()["body"] == "abc"
    writer.close()


async def test_idle_connection_is_closed_after_timeout(serve) -> None:
    server = await serve(idle_timeout_s=0.1)
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    writer.write(b"GET / HTTP/1.1\r\n")  # a head that never completes
    async with asyncio.timeout(30):
        assert await reader.read() == b""
    writer.close()
    with contextlib.suppress(ConnectionError):
        await writer.wait_closed()


async def test_unknown_paths_route_through_handler_and_head_has_no_body(serve) -> None:
    server = await serve()
    raw = request_bytes("HEAD", "/x", headers={"connection": "close"})
    data = await exchange(server.port, raw)
    head, _, rest = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200")
    assert rest == b""


async def test_slow_reader_applies_backpressure(serve) -> None:
    produced = 0
    chunk = b"data: " + b"x" * 1000 + b"\n\n"

    async def handler(request: Request) -> StreamingResponse:
        async def body() -> AsyncIterator[bytes]:
            nonlocal produced
            for _ in range(20_000):  # 20 MB: more than loopback's socket buffers hold
                produced += 1
                yield chunk

        return StreamingResponse(body())

    server = await serve(handler)
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 * 1024)
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", server.port))
    reader, writer = await asyncio.open_connection(sock=sock, limit=2**20)
    writer.write(request_bytes("GET", "/big", headers={"connection": "close"}))
    # Read nothing: kernel buffers fill, then ours, and the producer is held back.
    # Wait for production to stall (a slow machine may take longer than 0.3 s).
    await until(lambda: produced > 0)
    last = -1
    async with asyncio.timeout(60):
        while produced != last:
            last = produced
            await asyncio.sleep(0.3)
    (conn,) = server._connections
    assert conn.transport is not None
    assert produced < 20_000
    assert conn.transport.get_write_buffer_size() < 256 * 1024
    parts = []
    async with asyncio.timeout(120):
        while part := await reader.read(2**20):
            parts.append(part)
    (resp,) = parse_responses(b"".join(parts))
    assert resp.body == chunk * 20_000
    writer.close()
