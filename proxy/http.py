"""HTTP/1.1 server on asyncio with h11: keep-alive, streaming, limits, drain.

One :class:`_Connection` (an ``asyncio.Protocol``) per socket feeds bytes to
an ``h11.Connection`` and runs at most one handler task at a time, so
pipelined requests are answered in order (h11 pauses parsing until the
current response is complete). The handler gets a whole :class:`Request`
(bodies are small JSON) and returns a :class:`Response` or a
:class:`StreamingResponse` whose body is an async iterator of byte chunks,
sent with chunked transfer encoding and write flow control: while the
transport's buffer is over its high-water mark the body is not pulled, so a
client that stops reading holds at most one buffer of its stream here, and
after ``write_stall_timeout_s`` without draining it the stream is cut.

Error responses made here (400 malformed, 408 request too slow, 413 body too
large, 431 head too large, 429 too many requests, 503 draining or too many
connections, 500 handler bug) use OpenAI's error body, like the ones the
application raises through :class:`HttpError`.

Parsing is as strict as nginx where h11 is lenient: a bare LF line ending in
a request head, and a request with both ``Content-Length`` and
``Transfer-Encoding`` (RFC 9112 §6.1, a request-smuggling vector), get 400 and
the connection is closed. Limits (``proxy.*`` settings): open connections
(``max_connections``), idle keep-alive time (``idle_timeout_s``), the time a
head may take from its first byte (``head_timeout_s``) and a body from the end
of its head (``body_timeout_s``). An optional ``head_check`` (the API key) runs
as soon as a head arrives, so a refused client's body is never read.

A client that disconnects gets its handler task cancelled (message
``"client disconnected"``); the application's backend aborts upstream in
its cleanup. Every task is owned by the :class:`HttpServer`, which drains
them on :meth:`HttpServer.shutdown`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import secrets
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, cast
from urllib.parse import urlsplit

import h11
import structlog

from star.aio import deadline
from star.handshake import is_loopback
from star.settings import ProxySettings

log = structlog.get_logger()

JSON = "application/json"
DISCONNECTED = "client disconnected"
SHUTDOWN = "server shutdown"
# Pipelined bytes buffered while a request is in flight before we stop reading
# the socket (h11 buffers them unparsed, so its own size limit does not apply).
_PIPELINE_BUFFER = 256 * 1024
_LINGER_S = 2.0
_LIMIT_LOG_EVERY_S = 10.0
# The end of a request head as h11 finds it (it accepts bare LF line endings).
_HEAD_END = re.compile(rb"\n\r?\n")
# What a connection is waiting for; each has its own timeout.
_IDLE, _HEAD, _BODY = "idle", "head", "body"


@dataclass(frozen=True, slots=True)
class Request:
    """A complete HTTP request; header names are lower-case."""

    method: str
    path: str
    query: str
    headers: tuple[tuple[str, str], ...]
    body: bytes
    client: str = ""

    def header(self, name: str) -> str | None:
        """The first value of header ``name`` (lower-case), or None."""
        for key, value in self.headers:
            if key == name:
                return value
        return None


@dataclass(slots=True)
class Response:
    """A complete response; ``Content-Length`` is added when sent."""

    status: int = 200
    body: bytes = b""
    content_type: str = JSON
    headers: list[tuple[str, str]] = field(default_factory=list)

    @classmethod
    def json(
        cls, payload: Any, status: int = 200, headers: Iterable[tuple[str, str]] = ()
    ) -> Response:
        """Compact JSON, UTF-8, no ASCII escaping."""
        body = json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode()
        return cls(status, body, JSON, list(headers))


@dataclass(slots=True)
class StreamingResponse:
    """A response whose body is produced while it is sent (SSE).

    The server iterates ``body`` and closes it (``aclose``) however the
    response ends; the status line and headers go out before the first chunk.
    ``detach``: a client that goes away (or stalls past the write timeout)
    calls it instead of cancelling the handler, and the body is iterated on
    to its end, its bytes dropped (a stream held for a resume: proxy.resume).
    """

    body: AsyncIterator[bytes]
    status: int = 200
    content_type: str = "text/event-stream; charset=utf-8"
    headers: list[tuple[str, str]] = field(default_factory=list)
    detach: Callable[[], None] | None = None


Handler = Callable[[Request], Awaitable[Response | StreamingResponse]]
# Called with a request whose head has arrived (``body`` still empty) before
# its body is read; raising HttpError answers with it and closes (401 early).
HeadCheck = Callable[[Request], None]
# Called with (request path, or "" when the head was unreadable; status) for
# every response the server sends, including the ones it makes itself.
Observer = Callable[[str, int], None]


class HttpError(Exception):
    """An error response in OpenAI's format: ``{"error": {message, type, param, code}}``."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str | None = None,
        param: str | None = None,
        code: str | int | None = None,
        headers: Iterable[tuple[str, str]] = (),
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type or _default_type(status)
        self.param = param
        self.code = code
        self.headers = list(headers)

    def payload(self) -> dict[str, Any]:
        """The JSON body (also used for SSE error events)."""
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def response(self) -> Response:
        """As a complete response."""
        return Response.json(self.payload(), self.status, self.headers)


class InStreamError(HttpError):
    """An error vLLM's server tells a *streaming* client inside a 200 stream.

    Its OpenAI server starts the SSE response before the engine verifies
    the request's sampling parameters (``SamplingParams.verify``, e.g.
    logprobs above ``max_logprobs``): the error is the stream's one event,
    then ``[DONE]``. STAR answers such a stream the same way; the same
    request unstreamed is this error's status, as in vLLM.
    """


def _default_type(status: int) -> str:
    # vLLM's OpenAI server names a client error by its class (its
    # create_error_response: BadRequestError, NotFoundError); other statuses
    # keep OpenAI's names.
    if status == 400:
        return "BadRequestError"
    if status == 404:
        return "NotFoundError"
    if status == 429:
        return "rate_limit_exceeded"
    if status == 503:
        return "service_unavailable"
    return "server_error" if status >= 500 else "invalid_request_error"


class HttpServer:
    """Accepts connections and runs ``handler`` for each request.

    ``settings`` gives the listen address and the limits (``sock``, an
    already-bound listening socket, replaces the address); ``exempt_paths``
    (health checks, metrics) do not count toward ``max_streams`` so they keep
    answering under load. ``idle_timeout_s`` (default
    ``settings.idle_timeout_s``) closes keep-alive connections with no
    request in flight. ``head_check`` sees each request head before its body
    is read. ``observer`` sees the status of every response (metrics).
    """

    def __init__(
        self,
        handler: Handler,
        settings: ProxySettings,
        *,
        exempt_paths: Iterable[str] = ("/health", "/metrics"),
        idle_timeout_s: float | None = None,
        head_check: HeadCheck | None = None,
        observer: Observer | None = None,
        sock: socket.socket | None = None,
    ) -> None:
        self.handler = handler
        self.sock = sock
        self.observer = observer
        self.head_check = head_check
        self.settings = settings
        self.exempt_paths = frozenset(exempt_paths)
        self.idle_timeout_s = settings.idle_timeout_s if idle_timeout_s is None else idle_timeout_s
        self.active = 0  # requests in flight that count toward max_streams
        self.open = 0  # connections that count toward max_connections
        self.refused = 0  # connections refused at max_connections since the last log line
        self._refused_logged = 0.0
        self.draining = False
        self._server: asyncio.Server | None = None
        self._connections: set[_Connection] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        self._stopped = asyncio.Event()

    @property
    def address(self) -> tuple[str, int]:
        """The bound (host, port) (useful with port 0 or an inherited socket)."""
        if self._server is None or not self._server.sockets:
            raise RuntimeError("server is not listening")
        host, port = self._server.sockets[0].getsockname()[:2]
        return str(host), int(port)

    @property
    def port(self) -> int:
        """The bound port."""
        return self.address[1]

    async def start(self) -> None:
        """Bind and start accepting."""
        loop = asyncio.get_running_loop()
        if self.sock is not None:
            self._server = await loop.create_server(
                lambda: _Connection(self), sock=self.sock, backlog=2048
            )
        else:
            self._server = await loop.create_server(
                lambda: _Connection(self), self.settings.host, self.settings.port, backlog=2048
            )
        host, port = self.address
        log.info("http_listening", host=host, port=port)
        if not self.settings.api_key and not is_loopback(host):
            log.warning(
                "http_open_without_api_key",
                host=host,
                port=port,
                hint="any host that reaches this port may use the API: set proxy.api_key "
                "(STAR_PROXY_API_KEY) or bind proxy.host to 127.0.0.1",
            )

    async def serve(self) -> None:
        """Start, then wait until :meth:`shutdown` has finished."""
        if self._server is None:
            await self.start()
        await self._stopped.wait()

    async def shutdown(
        self, timeout_s: float | None = None, on_timeout: Callable[[], None] | None = None
    ) -> None:
        """Stop accepting, let requests in flight finish, cancel the rest.

        Idle connections close at once; busy ones answer with
        ``Connection: close`` and close after their response. After
        ``timeout_s`` (default ``settings.drain_timeout_s``) the remaining
        handler tasks are cancelled with message ``"server shutdown"``,
        ``on_timeout`` called first.
        """
        timeout = self.settings.drain_timeout_s if timeout_s is None else timeout_s
        self.draining = True
        if self._server is not None:
            self._server.close()
        for conn in list(self._connections):
            if conn.task is None:
                conn.close()
        pending = set(self._tasks)
        if pending:
            log.info("http_draining", requests=len(pending), timeout_s=timeout)
            _, pending = await asyncio.wait(pending, timeout=timeout)
        if pending and on_timeout is not None:
            on_timeout()
        for task in pending:
            task.cancel(SHUTDOWN)
        if pending:
            log.warning("http_drain_timeout", cancelled=len(pending))
            await asyncio.wait(pending)
        for conn in list(self._connections):
            conn.close()
        if self._server is not None:
            await self._server.wait_closed()
        self._stopped.set()

    # -- called by connections ---------------------------------------------

    def _refuse(self) -> None:
        """Count a connection refused at ``max_connections``; log now and then, not per refusal."""
        self.refused += 1
        now = time.monotonic()
        if now - self._refused_logged >= _LIMIT_LOG_EVERY_S:
            log.warning(
                "http_connection_limit",
                limit=self.settings.max_connections,
                refused=self.refused,
                setting="proxy.max_connections",
            )
            self._refused_logged, self.refused = now, 0

    def _spawn(self, conn: _Connection, request: Request, counted: bool) -> asyncio.Task[None]:
        task = asyncio.get_running_loop().create_task(conn.run(request, counted))
        self._tasks.add(task)
        task.add_done_callback(self._task_done)
        return task

    def _task_done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and (exc := task.exception()) is not None:
            # _Connection.run handles everything it expects; this is a bug.
            log.error("http_task_failed", exc_info=exc)


class _Connection(asyncio.Protocol):
    """One client socket; see the module docstring."""

    def __init__(self, server: HttpServer) -> None:
        self.server = server
        self.settings = server.settings
        self.h11 = h11.Connection(
            h11.SERVER, max_incomplete_event_size=server.settings.max_header_bytes
        )
        self.transport: asyncio.Transport | None = None
        self.client = ""
        self.task: asyncio.Task[None] | None = None
        self.closed = False
        self._head: h11.Request | None = None
        self._body: list[bytes] = []
        self._body_size = 0
        self._buffered = 0
        self._reading_paused = False
        self._write_paused = False
        self._drain: asyncio.Future[None] | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._phase: str | None = None  # what the timer waits for: _IDLE, _HEAD, _BODY
        self._counted = False  # toward max_connections
        self._head_only = False  # the request in flight is HEAD: send no body bytes
        self._lingering = False
        self._path = ""  # of the request being answered, for the observer
        self._head_sent = False  # the response's status line is out
        self._detach: Callable[[], None] | None = None  # of the streaming response in flight
        self._detached = False  # its client went away; the body runs on, unsent

    # -- asyncio.Protocol ----------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports do not subclass asyncio.Transport; same interface.
        self.transport = cast(asyncio.Transport, transport)
        peer = transport.get_extra_info("peername")
        self.client = f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else ""
        server = self.server
        server._connections.add(self)
        if server.draining:
            self.close()
            return
        if server.open >= self.settings.max_connections:
            server._refuse()
            limit = self.settings.max_connections
            self._reject(
                HttpError(
                    503,
                    f"too many open connections to this server (limit {limit}); retry later",
                    code="too_many_connections",
                    headers=[("retry-after", "1")],
                )
            )
            return
        server.open += 1
        self._counted = True
        self._arm(_IDLE)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.server._connections.discard(self)
        if self._counted:
            self._counted = False
            self.server.open -= 1
        self._disarm_timer()
        if self.task is not None and not self.task.done() and not self._detached:
            detach, self._detach = self._detach, None
            if detach is None:
                self.task.cancel(DISCONNECTED)
            else:
                self._detached = True
                detach()
        if self._drain is not None and not self._drain.done():
            self._drain.set_result(None)

    def eof_received(self) -> bool | None:
        # A client that half-closes is treated as gone (as uvicorn does);
        # returning None lets the transport close and call connection_lost.
        return None

    def data_received(self, data: bytes) -> None:
        if self._lingering:
            return  # the rest of a body we refused; read only so the client sees our answer
        self.h11.receive_data(data)
        if self.task is None:
            self._process()
            return
        self._buffered += len(data)
        if self._buffered > _PIPELINE_BUFFER and not self._reading_paused:
            assert self.transport is not None
            self.transport.pause_reading()
            self._reading_paused = True

    def pause_writing(self) -> None:
        self._write_paused = True

    def resume_writing(self) -> None:
        self._write_paused = False
        if self._drain is not None and not self._drain.done():
            self._drain.set_result(None)

    # -- parsing ---------------------------------------------------------------

    def _process(self) -> None:
        """Pull h11 events until a request is complete or more bytes are needed."""
        while self.task is None and not self._closing:
            if self.h11.their_state is h11.IDLE and not self._check_head_bytes():
                return
            try:
                event = self.h11.next_event()
            except h11.RemoteProtocolError as exc:
                status = exc.error_status_hint
                if status == 431:
                    error = HttpError(
                        431, "request head too large", code="request_header_too_large"
                    )
                else:
                    error = HttpError(status, f"malformed HTTP request: {exc}", code="bad_request")
                self._reject(error)
                return
            if event is h11.NEED_DATA or event is h11.PAUSED:
                return
            if isinstance(event, h11.Request):
                if not self._start_request(event):
                    return
            elif isinstance(event, h11.Data):
                self._body_size += len(event.data)
                if self._body_size > self.settings.max_body_bytes:
                    self._reject(self._too_large())
                    return
                self._body.append(event.data)
            elif isinstance(event, h11.EndOfMessage):
                self._dispatch()
                if self.task is None:  # answered at once (429/503): next pipelined request
                    self._next_cycle(process=False)
            elif isinstance(event, h11.ConnectionClosed):
                self.close()
                return

    def _check_head_bytes(self) -> bool:
        """Before h11 parses a head: start its timer, refuse bare LF. False: rejected."""
        pending = self.h11.trailing_data[0]
        if not pending:
            return True
        if self._phase == _IDLE:
            self._arm(_HEAD)  # the first byte of a request: the head timeout runs from here
        if _bare_lf(pending):
            self._reject(
                HttpError(
                    400,
                    "malformed HTTP request: a line of the head ends in a bare LF (CRLF required)",
                    code="bad_request",
                )
            )
            return False
        return True

    def _start_request(self, head: h11.Request) -> bool:
        """Checks on a complete head; the body is not read unless they pass (False: rejected)."""
        self._head_only = head.method == b"HEAD"
        self._path = urlsplit(head.target.decode("latin-1")).path
        # h11's max_incomplete_event_size only bites while a head is still
        # incomplete; one that arrived whole in a single read is measured here.
        if _head_size(head) > self.settings.max_header_bytes:
            self._reject(HttpError(431, "request head too large", code="request_header_too_large"))
            return False
        names = {name for name, _ in head.headers}
        if b"content-length" in names and b"transfer-encoding" in names:
            # RFC 9112 §6.1: the framing is ambiguous (request smuggling); close.
            error = HttpError(
                400,
                "malformed HTTP request: both Content-Length and Transfer-Encoding are set",
                code="bad_request",
            )
            self._reject(error)
            return False
        if self.server.head_check is not None:
            try:
                self.server.head_check(self._request(head, b""))
            except HttpError as exc:  # e.g. 401: refused before its body is read
                self._reject(exc)
                return False
        length = _content_length(head.headers)
        if length is not None and length > self.settings.max_body_bytes:
            # Refuse before reading the body; the connection cannot be reused.
            self._reject(self._too_large())
            return False
        self._head, self._body, self._body_size = head, [], 0
        self._arm(_BODY)
        if self.h11.they_are_waiting_for_100_continue:
            self._send(h11.InformationalResponse(status_code=100, headers=[]))
        return True

    def _too_large(self) -> HttpError:
        return HttpError(
            413,
            f"request body larger than {self.settings.max_body_bytes} bytes",
            code="request_too_large",
        )

    def _request(self, head: h11.Request, body: bytes) -> Request:
        parts = urlsplit(head.target.decode("latin-1"))
        return Request(
            method=head.method.decode("ascii"),
            path=parts.path or "/",
            query=parts.query,
            headers=tuple((k.decode("latin-1"), v.decode("latin-1")) for k, v in head.headers),
            body=body,
            client=self.client,
        )

    def _dispatch(self) -> None:
        head = self._head
        assert head is not None
        self._head = None
        request = self._request(head, b"".join(self._body))
        self._body = []
        counted = request.path not in self.server.exempt_paths
        self._disarm_timer()
        if self.server.draining:
            self._send_full(
                HttpError(503, "server is shutting down", code="shutting_down").response()
            )
            return
        if counted and self.server.active >= self.settings.max_streams:
            error = HttpError(
                429,
                f"too many concurrent requests (limit {self.settings.max_streams})",
                code="rate_limit_exceeded",
                headers=[("retry-after", "1")],
            )
            self._send_full(error.response())
            return
        if counted:
            self.server.active += 1
        self._buffered = 0
        self.task = self.server._spawn(self, request, counted)

    # -- responding ------------------------------------------------------------

    async def run(self, request: Request, counted: bool) -> None:
        """The handler task: call the application, send its response."""
        try:
            try:
                response = await self.server.handler(request)
            except HttpError as exc:
                response = exc.response()
            except Exception:
                request_id = new_request_id()
                log.exception(
                    "http_handler_failed",
                    method=request.method,
                    path=request.path,
                    request_id=request_id,
                )
                response = internal_error(request_id).response()
            if isinstance(response, StreamingResponse):
                await self._stream(response)
            else:
                self._send_full(response)
        except asyncio.CancelledError:
            if not self._head_sent and not self._closing:
                # Shutdown overtook a request that has not answered yet.
                error = HttpError(503, "server is shutting down", code="shutting_down")
                self._send_full(error.response())
                self.close()
            else:
                self.abort()  # client gone, or shutdown cut a response short
            raise
        finally:
            if counted:
                self.server.active -= 1
            self.task = None
        self._next_cycle()

    def _headers(
        self, status: int, content_type: str, extra: list[tuple[str, str]]
    ) -> list[tuple[str, str]]:
        headers = [("content-type", content_type), *extra]
        if self.server.draining:
            headers.append(("connection", "close"))
        return headers

    def _send_full(self, response: Response) -> None:
        headers = self._headers(response.status, response.content_type, response.headers)
        headers.append(("content-length", str(len(response.body))))
        self._send_head(response.status, headers)
        if response.body and not self._head_only:
            self._send(h11.Data(data=response.body))
        self._send(h11.EndOfMessage())

    async def _stream(self, response: StreamingResponse) -> None:
        body = response.body
        try:
            headers = self._headers(response.status, response.content_type, response.headers)
            headers.append(("cache-control", "no-cache"))
            headers.append(("x-accel-buffering", "no"))  # tell nginx & co. not to buffer SSE
            chunked = self.h11.their_http_version == b"1.1" and not self._head_only
            if chunked:
                headers.append(("transfer-encoding", "chunked"))
            self._send_head(response.status, headers)
            if self._head_only:
                self._send(h11.EndOfMessage())
                return
            transport = self.transport
            assert transport is not None
            if not self.closed:
                self._detach = response.detach
            async for chunk in body:
                if not chunk or self.closed or self._detached:
                    pass
                elif chunked:
                    # The per-token hot path. h11 stays in SEND_BODY and writes
                    # the last-chunk at EndOfMessage; framing one chunk is one
                    # format, and skipping h11's per-event machinery here saves
                    # a fifth of the proxy's CPU per token.
                    transport.write(b"%x\r\n%b\r\n" % (len(chunk), chunk))
                else:  # an HTTP/1.0 client: close-delimited body, through h11
                    self._send(h11.Data(data=chunk))
                if self._detached:
                    continue
                if self._write_paused and not self.closed and not await self._drained():
                    detach, self._detach = self._detach, None  # the client is cut
                    if detach is None:
                        return
                    self._detached = True
                    detach()
                if self.closed and not self._detached:
                    return
            self._send(h11.EndOfMessage())
        except asyncio.CancelledError:
            raise
        except Exception:
            # Headers are out; the only honest signal left is to cut the
            # connection, so the client sees an unterminated chunked body.
            log.exception("http_stream_failed")
            self.abort()
        finally:
            self._detach, self._detached = None, False
            aclose = getattr(body, "aclose", None)
            if aclose is not None:
                await aclose()

    async def _drained(self) -> bool:
        """Wait until the client takes the buffered bytes; False: it did not in time, cut.

        The body is not pulled meanwhile, so its producer (the backend stream)
        waits with it; a client that reads nothing would hold its stream, and
        the upstream request, for ever.
        """
        self._drain = asyncio.get_running_loop().create_future()
        timeout_s = self.settings.write_stall_timeout_s
        try:
            async with deadline(timeout_s):
                await self._drain
        except TimeoutError:
            assert self.transport is not None
            log.warning(
                "http_stream_write_stalled",
                client=self.client,
                path=self._path,
                buffered_bytes=self.transport.get_write_buffer_size(),
                timeout_s=timeout_s,
                setting="proxy.write_stall_timeout_s",
            )
            self.abort()
            return False
        finally:
            self._drain = None
        return True

    def _reject(self, error: HttpError) -> None:
        """Answer a request we will not read to the end, then close."""
        if self.h11.our_state in (h11.IDLE, h11.SEND_RESPONSE):
            with contextlib.suppress(h11.LocalProtocolError):
                response = error.response()
                headers = [
                    ("content-type", response.content_type),
                    *response.headers,
                    ("connection", "close"),
                    ("content-length", str(len(response.body))),
                ]
                self._send_head(error.status, headers)
                if not self._head_only:
                    self._send(h11.Data(data=response.body))
                self._send(h11.EndOfMessage())
        self._linger()

    def _next_cycle(self, process: bool = True) -> None:
        """After a response: close, or reset h11 for the next request on this socket."""
        if self.closed:
            return
        if self.h11.our_state is h11.MUST_CLOSE or self.h11.their_state is h11.MUST_CLOSE:
            self.close()
            return
        if self.h11.our_state is not h11.DONE or self.h11.their_state is not h11.DONE:
            self.close()  # a response cut short (stream aborted); nothing sane to reuse
            return
        self.h11.start_next_cycle()
        self._head_only = False
        self._head_sent = False
        self._path = ""
        if self.server.draining:
            self.close()
            return
        self._arm(_IDLE)
        if self._reading_paused:
            assert self.transport is not None
            self.transport.resume_reading()
            self._reading_paused = False
        if process:
            self._process()

    def _send_head(self, status: int, headers: list[tuple[str, str]]) -> None:
        self._send(h11.Response(status_code=status, headers=headers))
        self._head_sent = True
        if self.server.observer is not None:
            self.server.observer(self._path, status)

    def _send(self, event: h11.Event) -> None:
        data = self.h11.send(event)
        if data and not self.closed and self.transport is not None:
            self.transport.write(data)

    # -- closing and timers ------------------------------------------------------

    def close(self) -> None:
        """Close after the buffered response bytes are written."""
        if self.transport is not None and not self.transport.is_closing():
            self.transport.close()

    @property
    def _closing(self) -> bool:
        return self.closed or self.transport is None or self.transport.is_closing()

    def _linger(self) -> None:
        """Close our side but keep reading (and dropping) a while.

        Closing a socket with unread request bytes makes the kernel send RST,
        which can destroy the error response before the client reads it.
        """
        transport = self.transport
        if transport is None or transport.is_closing():
            return
        if not transport.can_write_eof():
            transport.close()
            return
        self._lingering = True
        transport.write_eof()
        self._disarm_timer()
        self._timer = asyncio.get_running_loop().call_later(_LINGER_S, self.close)

    def abort(self) -> None:
        """Close at once, dropping unsent bytes."""
        if self.transport is not None:
            self.transport.abort()

    def _arm(self, phase: str) -> None:
        """Start the timeout of ``phase`` (waiting for a request, its head, its body)."""
        self._disarm_timer()
        self._phase = phase
        if phase == _IDLE:
            timeout_s = self.server.idle_timeout_s
        elif phase == _HEAD:
            timeout_s = self.settings.head_timeout_s
        else:
            timeout_s = self.settings.body_timeout_s
        self._timer = asyncio.get_running_loop().call_later(timeout_s, self._expired)

    def _disarm_timer(self) -> None:
        self._phase = None
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _expired(self) -> None:
        phase, self._timer, self._phase = self._phase, None, None
        if self.task is not None or self._closing:
            return
        if phase == _IDLE:
            self.close()
            return
        setting = f"proxy.{phase}_timeout_s"
        timeout_s = getattr(self.settings, f"{phase}_timeout_s")
        log.info(
            "http_request_too_slow",
            client=self.client,
            path=self._path,
            waiting_for=phase,
            timeout_s=timeout_s,
            setting=setting,
        )
        self._reject(
            HttpError(
                408,
                f"request {phase} not received within {timeout_s:g} s",
                code="request_timeout",
            )
        )


def new_request_id() -> str:
    """An id for an error the client sees and the log explains (``req-`` + 16 hex)."""
    return "req-" + secrets.token_hex(8)


def internal_error(request_id: str) -> HttpError:
    """The 500 for a bug: no exception text, the id that finds it in the log."""
    return HttpError(500, f"internal server error (request id {request_id})")


def _bare_lf(data: bytes) -> bool:
    """Whether the request head at the start of ``data`` has a line ending in LF without CR.

    Only the head (up to its blank line, or all of ``data`` while the head is
    incomplete) is looked at; a body may hold any bytes.
    """
    end = _HEAD_END.search(data)
    head = data[: end.end()] if end else data
    return head.count(b"\n") != head.count(b"\r\n")


def _content_length(headers: Iterable[tuple[bytes, bytes]]) -> int | None:
    for name, value in headers:
        if name == b"content-length":
            return int(value)  # h11 has already checked it is a valid integer
    return None


def _head_size(head: h11.Request) -> int:
    """Bytes of the request head as sent (give or take whitespace h11 stripped)."""
    size = len(head.method) + len(head.target) + 12
    for name, value in head.headers:
        size += len(name) + len(value) + 4
    return size
