"""A client that stops reading: its stream waits (bounded), the others go on, then it is cut."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections.abc import AsyncIterator

import structlog

from proxy.http import HttpServer, Request, StreamingResponse
from star.settings import ProxySettings
from tests.proxy.rawhttp import exchange, parse_responses, request_bytes, until

CHUNK = b"x" * 16_384
STALL_S = 1.5


class Streams:
    """``/flood``: 16 KiB chunks as fast as they are taken; ``/paced``: 40 small ones, 10 ms apart."""

    def __init__(self) -> None:
        self.pulled = 0  # bytes of /flood taken by the server
        self.flood_closed = asyncio.Event()

    async def __call__(self, request: Request) -> StreamingResponse:
        return StreamingResponse(self._flood() if request.path == "/flood" else self._paced())

    async def _flood(self) -> AsyncIterator[bytes]:
        try:
            while True:
                self.pulled += len(CHUNK)
                yield CHUNK
                await asyncio.sleep(0)
        finally:
            self.flood_closed.set()

    async def _paced(self) -> AsyncIterator[bytes]:
        for i in range(40):
            await asyncio.sleep(0.01)
            yield b"data: %d\n\n" % i


async def _stalled_client(port: int) -> socket.socket:
    """Send a request for /flood and never read the answer (a small receive window)."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", port))
    sock.sendall(request_bytes("GET", "/flood"))
    return sock


async def test_a_client_that_stops_reading_is_bounded_does_not_stall_others_and_is_cut() -> None:
    streams = Streams()
    settings = ProxySettings(host="127.0.0.1", port=0, write_stall_timeout_s=STALL_S)
    server = HttpServer(streams, settings)
    await server.start()
    stalled = await _stalled_client(server.port)
    try:
        with structlog.testing.capture_logs() as logs:
            # The kernel's buffers fill, then the transport's; then nothing is pulled.
            await until(lambda: streams.pulled > 0)
            t0 = time.monotonic()
            await until(lambda: any(c._write_paused for c in server._connections), wait_s=10)
            pulled = streams.pulled
            buffered = max(c.transport.get_write_buffer_size() for c in server._connections)  # type: ignore[union-attr]
            # Meanwhile, other streams are served at their pace.
            started = time.monotonic()
            answers = await asyncio.gather(
                *(
                    exchange(
                        server.port, request_bytes("GET", "/paced", headers={"connection": "close"})
                    )
                    for _ in range(5)
                )
            )
            took = time.monotonic() - started
            assert time.monotonic() - t0 < STALL_S, "the check must run while the stream is held"
            assert streams.pulled == pulled, "the body was pulled while its client was not reading"
            assert buffered <= 64 * 1024 + len(CHUNK)
            assert pulled < 16 * 1024 * 1024
            for raw in answers:
                (resp,) = parse_responses(raw)
                assert resp.status == 200 and resp.body.count(b"data: ") == 40
            assert took < 1.0
            # Then the stalled stream is cut, its body closed, and the slot freed.
            async with asyncio.timeout(STALL_S + 5):
                await streams.flood_closed.wait()
            assert time.monotonic() - t0 >= STALL_S - 0.1
            await until(lambda: server.active == 0, wait_s=5)
        (line,) = [e for e in logs if e["event"] == "http_stream_write_stalled"]
        assert line["log_level"] == "warning" and line["timeout_s"] == STALL_S
        assert line["setting"] == "proxy.write_stall_timeout_s"
    finally:
        stalled.close()
        with contextlib.suppress(Exception):
            await server.shutdown(timeout_s=1.0)
