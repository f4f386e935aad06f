"""The HTTP layer over raw sockets: limits, errors, keep-alive, disconnects, drain."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest
import structlog

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
        handler: Handler = echo, idle_timeout_s: float | None = None, **kw: object
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
    assert err["type"] == "BadRequestError"
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
    async with asyncio.timeout(30):
        assert await reader.read() == b""  # nothing sent: closed without a word
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


# -- as strict as nginx (issue 27 item 5) ---------------------------------------------


async def _connect(port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    return await asyncio.open_connection("127.0.0.1", port)


async def _close(writer: asyncio.StreamWriter) -> None:
    writer.close()
    with contextlib.suppress(ConnectionError):
        await writer.wait_closed()


async def test_connections_beyond_max_connections_get_503_and_are_closed(serve) -> None:
    server = await serve(max_connections=3)
    idle = [await _connect(server.port) for _ in range(3)]
    for reader, writer in idle:  # one request each, then idle keep-alive: they still count
        writer.write(request_bytes("GET", "/keep"))
        async with asyncio.timeout(30):
            head = await reader.readuntil(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200")
    reader, writer = await _connect(server.port)
    writer.write(request_bytes("GET", "/over"))
    async with asyncio.timeout(30):
        (resp,) = parse_responses(await reader.read())  # answered, then closed
    err = assert_openai_error(resp, 503)
    assert err["code"] == "too_many_connections" and "limit 3" in str(err["message"])
    assert resp.headers["connection"] == "close" and resp.headers["retry-after"] == "1"
    await _close(writer)
    assert ("/over", 200) not in server.seen  # type: ignore[attr-defined]
    # A connection that goes frees its place.
    await _close(idle[0][1])
    await until(lambda: server.open == 2)
    data = await exchange(server.port, request_bytes("GET", "/in", headers={"connection": "close"}))
    (ok,) = parse_responses(data)
    assert ok.status == 200 and ok.json()["path"] == "/in"
    for _, w in idle[1:]:
        await _close(w)
    await until(lambda: server.open == 0)


async def test_a_head_trickling_past_head_timeout_gets_408(serve) -> None:
    # Slowloris: a byte now and then keeps an idle timer alive; the head timer runs
    # from the first byte, whatever follows.
    server = await serve(head_timeout_s=0.5)
    reader, writer = await _connect(server.port)
    loop = asyncio.get_running_loop()
    start = loop.time()
    answer = asyncio.create_task(reader.read())
    for byte in b"GET / HTTP/1.1\r\nhost: a\r\nx-slow: " + b"a" * 200:
        if answer.done():
            break
        writer.write(bytes([byte]))
        await asyncio.sleep(0.02)
    async with asyncio.timeout(30):
        (resp,) = parse_responses(await answer)
    took = loop.time() - start
    err = assert_openai_error(resp, 408)
    assert err["code"] == "request_timeout" and "head" in str(err["message"])
    assert resp.headers["connection"] == "close"
    assert 0.4 < took < 3.0
    await _close(writer)


async def test_a_body_slower_than_body_timeout_gets_408(serve) -> None:
    calls: list[Request] = []

    async def handler(request: Request) -> Response:
        calls.append(request)
        return Response.json({})

    server = await serve(handler, body_timeout_s=0.3)
    reader, writer = await _connect(server.port)
    writer.write(b"POST /b HTTP/1.1\r\nhost: a\r\ncontent-length: 10\r\n\r\nabc")  # 7 short
    async with asyncio.timeout(30):
        (resp,) = parse_responses(await reader.read())
    err = assert_openai_error(resp, 408)
    assert "body" in str(err["message"])
    assert calls == []
    assert ("/b", 408) in server.seen  # type: ignore[attr-defined]
    await _close(writer)


async def test_timeouts_are_settings() -> None:
    settings = ProxySettings()
    assert (settings.head_timeout_s, settings.body_timeout_s, settings.idle_timeout_s) == (
        30.0,
        60.0,
        75.0,
    )
    server = HttpServer(echo, ProxySettings(idle_timeout_s=5.0))
    assert server.idle_timeout_s == 5.0


async def test_head_check_refuses_before_the_body_is_read(serve) -> None:
    calls: list[Request] = []

    def check(request: Request) -> None:
        assert request.body == b""
        if request.header("authorization") != "Bearer k":
            raise HttpError(401, "no key", headers=[("www-authenticate", "Bearer")])

    async def handler(request: Request) -> Response:
        calls.append(request)
        return Response.json({"body": len(request.body)})

    settings = ProxySettings(host="127.0.0.1", port=0)
    server = HttpServer(handler, settings, head_check=check)
    await server.start()
    try:
        # A body announced and never sent, behind "expect: 100-continue": the 401
        # comes at once, without a 100 before it.
        raw = b"POST /x HTTP/1.1\r\nhost: a\r\ncontent-length: 1000000\r\nexpect: 100-continue\r\n\r\n"
        (resp,) = parse_responses(await exchange(server.port, raw, wait_s=10))
        assert resp.status == 401 and resp.headers["www-authenticate"] == "Bearer"
        assert resp.headers["connection"] == "close"
        raw = request_bytes(
            "POST", "/x", b"abc", {"authorization": "Bearer k", "connection": "close"}
        )
        (ok,) = parse_responses(await exchange(server.port, raw))
        assert ok.status == 200 and ok.json() == {"body": 3}
        assert len(calls) == 1
    finally:
        await server.shutdown(timeout_s=1.0)


async def test_content_length_and_transfer_encoding_together_get_400_and_close(serve) -> None:
    # RFC 9112 §6.1: the framing is ambiguous; a server that picks one and reads on
    # serves whatever the other reading would have called body (request smuggling).
    server = await serve()
    smuggled = request_bytes("GET", "/smuggled", headers={"connection": "close"})
    raw = (
        b"POST /a HTTP/1.1\r\nhost: a\r\ncontent-length: 5\r\ntransfer-encoding: chunked\r\n\r\n"
        b"0\r\n\r\n" + smuggled
    )
    responses = parse_responses(await exchange(server.port, raw, wait_s=10))
    assert len(responses) == 1, [r.status for r in responses]
    err = assert_openai_error(responses[0], 400)
    assert "Content-Length and Transfer-Encoding" in str(err["message"])
    assert responses[0].headers["connection"] == "close"
    assert [path for path, _ in server.seen] == ["/a"]  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    "raw",
    [
        b"GET / HTTP/1.1\nhost: a\n\n",
        b"GET / HTTP/1.1\r\nhost: a\n\r\n",
        b"GET / HTTP/1.1\r\nhost: a\r\n\n",
        b"GET /first HTTP/1.1\r\nhost: a\r\n\r\nGET /second HTTP/1.1\nhost: a\r\n\r\n",
    ],
)
async def test_bare_lf_line_endings_get_400(serve, raw: bytes) -> None:
    server = await serve()
    responses = parse_responses(await exchange(server.port, raw, wait_s=10))
    assert responses, "no answer"
    err = assert_openai_error(responses[-1], 400)
    assert "bare LF" in str(err["message"])
    assert responses[-1].headers["connection"] == "close"
    assert [r.status for r in responses[:-1]] == [200] * (len(responses) - 1)


async def test_crlf_split_across_reads_and_lf_in_a_body_are_fine(serve) -> None:
    server = await serve()
    reader, writer = await _connect(server.port)
    for part in (b"POST /s HTTP/1.1\r", b"\nhost: a\r\ncontent-length: 3\r\n", b"\r", b"\na\nb"):
        writer.write(part)
        await writer.drain()
        await asyncio.sleep(0.05)
    async with asyncio.timeout(30):
        head = await reader.readuntil(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200")
    await _close(writer)


async def test_a_500_names_a_request_id_the_log_explains(serve) -> None:
    async def handler(request: Request) -> Response:
        raise RuntimeError("secret internals at 10.9.8.7:7001")

    server = await serve(handler)
    with structlog.testing.capture_logs() as logs:
        (resp,) = parse_responses(
            await exchange(server.port, request_bytes("GET", "/", headers={"connection": "close"}))
        )
    err = assert_openai_error(resp, 500)
    message = str(err["message"])
    assert "10.9.8.7" not in message and "RuntimeError" not in message
    request_id = message.rsplit("request id ", 1)[1].rstrip(")")
    (line,) = [e for e in logs if e["event"] == "http_handler_failed"]
    assert line["request_id"] == request_id and line["exc_info"]


@pytest.mark.parametrize(
    ("host", "key", "warned"),
    [("0.0.0.0", "", True), ("0.0.0.0", "sekrit", False), ("127.0.0.1", "", False)],
)
async def test_binding_beyond_loopback_without_a_key_warns(
    host: str, key: str, warned: bool
) -> None:
    server = HttpServer(echo, ProxySettings(host=host, port=0, api_key=key))
    with structlog.testing.capture_logs() as logs:
        await server.start()
    await server.shutdown(timeout_s=1.0)
    lines = [e for e in logs if e["event"] == "http_open_without_api_key"]
    assert bool(lines) is warned
    if warned:
        assert lines[0]["log_level"] == "warning" and "proxy.api_key" in lines[0]["hint"]
