"""The internal token protocol over asyncio TCP (the worker's IO adapter).

One :class:`TokenServer` per worker; each accepted connection is served by a
:class:`_Connection` that greets with Hello, reads frames, and runs every
Generate as its own task (owned by the connection, so none is orphaned).
The protocol's rules live in :mod:`workers.protocol`; this module only moves
bytes and tasks around them:

* with a cluster secret, a connection first runs the handshake of
  :mod:`star.handshake`; a peer that fails it is logged (``peer_refused``),
  counted (:attr:`TokenServer.refused`) and closed having received only the
  Challenge: no Hello, no error, no detail;
* a frame that fails to decode is answered with an Error and the connection
  goes on; an oversized frame is answered and the connection closed (the
  stream position is lost);
* Abort, or the connection closing, cancels the stream's task, which closes
  the engine's generator and so aborts the request upstream and frees its KV;
* each stream's writes await the socket's drain, so a slow reader makes vLLM
  coalesce deltas instead of the worker buffering without bound;
* every Ping is answered with a Pong; the first Ping on a connection (a
  proxy that checks liveness sends one right after Hello, an older one never
  does) starts this side's liveness check (``liveness_timeout_s``,
  :mod:`star.liveness`): a proxy silent for the whole bound is dropped like
  a closed connection, its streams aborted and their KV freed.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import socket
from dataclasses import dataclass

import structlog

from star import handshake
from star.aio import deadline
from star.handshake import Channel, ChannelBroken, HandshakeFailed, WorkerHandshake
from star.liveness import DEFAULT_TIMEOUT_S, Heartbeat, watch
from star.wire import (
    CONNECTION_STREAM,
    MAX_FRAME_BYTES,
    Abort,
    Attach,
    Error,
    ErrorCode,
    FrameDecoder,
    FrameTooLarge,
    Generate,
    Handoff,
    Hello,
    Message,
    Ping,
    Pong,
    Release,
    Tokens,
    WireError,
    frame,
)
from workers.protocol import (
    Engine,
    GenerateRequest,
    ShuttingDown,
    StreamEvent,
    StreamState,
    WorkerError,
    error_frame,
    next_state,
)
from workers.resumable import Orphans, Record

log = structlog.get_logger(__name__)

_READ_CHUNK = 256 * 1024


@dataclass(slots=True)
class _Stream:
    id: int
    request_id: str
    task: asyncio.Task[None]
    state: StreamState = StreamState.RUNNING
    conn: _Connection | None = None  # the proxy's connection (None: an orphan)
    record: Record | None = None  # a resumable request's (workers.resumable)


class _Connection:
    """One proxy connection: its streams and their tasks."""

    def __init__(
        self,
        server: TokenServer,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
    ) -> None:
        self.server = server
        self.reader = reader
        self.writer = writer
        self.streams: dict[int, _Stream] = {}
        self.closing = False
        # Liveness: armed by the proxy's first Ping (None: not checked).
        self.beat: Heartbeat | None = None
        self.watch: asyncio.Task[None] | None = None
        self.silent = False  # dropped because the proxy went silent
        self.channel: Channel | None = None  # sealed frames, once the handshake is done
        peer = writer.get_extra_info("peername")
        self.peer = f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else str(peer)
        self.log = log.bind(peer=self.peer)

    # -- writing ------------------------------------------------------------------

    def write(self, msg: Message) -> bool:
        """Queue one frame; False when the connection is already gone."""
        if self.closing or self.writer.is_closing():
            return False
        self.writer.write(frame(msg, self.channel.seal if self.channel is not None else None))
        return True

    async def send(self, msg: Message) -> None:
        """Write one frame and wait until the socket takes it (backpressure)."""
        if self.write(msg):
            await self.writer.drain()

    # -- reading ------------------------------------------------------------------

    async def run(self) -> None:
        """Serve the connection until the peer closes it (or the server shuts down)."""
        decoder = FrameDecoder(self.server.max_frame)
        clock = asyncio.get_running_loop().time
        try:
            if self.server.key is not None:
                if not await self._authenticate():
                    return
                assert self.channel is not None
                decoder.opener = self.channel.open
            await self.send(self.server.hello)
            while True:
                data = await self.reader.read(_READ_CHUNK)
                if not data:
                    break
                beat = self.beat
                if beat is not None:
                    beat.last_received = clock()
                decoder.feed(data)
                if not self._drain_frames(decoder):
                    break
        except (ConnectionError, asyncio.IncompleteReadError) as exc:
            self.log.info("connection_lost", error=str(exc))
        finally:
            await self.close()

    async def _authenticate(self) -> bool:
        """Run the worker's side of the handshake; False (logged, counted) if the peer fails."""
        assert self.server.key is not None
        shake = WorkerHandshake(self.server.key, self.server.address)
        decoder = FrameDecoder(handshake.MAX_FRAME_BYTES)
        try:
            await self.send(shake.challenge())
            async with deadline(self.server.handshake_timeout_s):
                msg = await self._first_frame(decoder)
            accept = shake.answer(msg)
            if decoder.buffered:
                # A proxy waits for Hello before it sends anything else.
                raise HandshakeFailed("early_frame", "bytes after the answer")
        except HandshakeFailed as exc:
            reason = exc.reason
        except TimeoutError:
            reason = "timeout"
        except FrameTooLarge:
            reason = "frame_too_large"
        except WireError:
            reason = "bad_frame"
        except (ConnectionError, asyncio.IncompleteReadError):
            reason = "closed"
        else:
            await self.send(accept)
            self.channel = Channel(shake.session, "worker")  # every frame after the Accept
            return True
        self.server.note_refused(self.peer, reason)
        return False

    async def _first_frame(self, decoder: FrameDecoder) -> Message:
        while True:
            data = await self.reader.read(handshake.MAX_FRAME_BYTES)
            if not data:
                raise ConnectionError("closed before answering")
            decoder.feed(data)
            for msg in decoder:
                return msg

    def _drain_frames(self, decoder: FrameDecoder) -> bool:
        """Handle every complete frame; False when the connection must close."""
        while True:
            try:
                msg = next(decoder)
            except StopIteration:
                return True
            except FrameTooLarge as exc:
                self.log.warning("frame_too_large_closing", error=str(exc))
                self.write(Error(CONNECTION_STREAM, ErrorCode.FRAME_TOO_LARGE.value, str(exc)))
                return False
            except ChannelBroken as exc:  # altered, injected or replayed: nothing to answer
                self.log.warning("frame_failed_authentication_closing", error=str(exc))
                return False
            except WireError as exc:
                self.log.warning("bad_frame", error=str(exc))
                self.write(Error(CONNECTION_STREAM, ErrorCode.BAD_FRAME.value, str(exc)))
                continue
            self._handle(msg)

    def _handle(self, msg: Message) -> None:
        if isinstance(msg, Generate):
            self._on_generate(msg)
        elif isinstance(msg, Abort):
            self._on_abort(msg.stream)
        elif isinstance(msg, Release):
            self._on_release(msg)
        elif isinstance(msg, Attach):
            self._on_attach(msg)
        elif isinstance(msg, Ping):
            self.write(Pong(msg.seq))
            self._arm()
        elif isinstance(msg, Pong):
            pass  # its bytes were proof enough
        else:
            # Hello, Tokens, Handoff, Error: frames only a worker sends.
            stream = getattr(msg, "stream", CONNECTION_STREAM)
            self.write(
                Error(
                    stream,
                    ErrorCode.BAD_FRAME.value,
                    f"a worker does not accept {msg.KIND!r} frames",
                )
            )

    # -- liveness -----------------------------------------------------------------------

    def _arm(self) -> None:
        """Start checking the proxy's liveness (once; not with the bound at 0)."""
        timeout = self.server.liveness_timeout_s
        if self.beat is not None or timeout <= 0 or self.closing:
            return
        self.beat = Heartbeat(timeout, asyncio.get_running_loop().time())
        self.watch = asyncio.create_task(
            watch(self.beat, self._ping, self._silent), name=f"liveness-{self.peer}"
        )

    def _ping(self, seq: int) -> None:
        self.write(Ping(seq))

    def _silent(self, silent_s: float) -> bool:
        """Nothing from the proxy for the whole bound: drop it as if it had closed."""
        self.silent = True
        self.log.warning(
            "proxy_silent_connection_dropped",
            silent_s=round(silent_s, 3),
            streams=len(self.streams),
            liveness_timeout_s=self.server.liveness_timeout_s,
        )
        # No FIN handshake with a peer that does not answer: the read loop sees
        # EOF at once, and close() aborts the streams (a blocked drain raises).
        self.writer.transport.abort()
        return True

    # -- stream lifecycle -------------------------------------------------------------

    def _on_generate(self, msg: Generate) -> None:
        if msg.stream in self.streams:
            self.write(
                Error(
                    msg.stream,
                    ErrorCode.DUPLICATE_STREAM.value,
                    f"stream {msg.stream} is already open",
                )
            )
            return
        if self.server.draining:
            self.write(error_frame(msg.stream, ShuttingDown("the worker is shutting down")))
            return
        request = GenerateRequest.from_frame(msg)
        # The same request as an orphan here: its proxy lost the connection and
        # continues it (a recovery) rather than attaching it; the orphan goes first.
        before = self.server.drop_orphan(msg.request_id)
        stream = _Stream(id=msg.stream, request_id=msg.request_id, task=None, conn=self)  # type: ignore[arg-type]
        stream.record = Record.of(msg)
        stream.task = asyncio.create_task(
            self._run_stream(stream, request, before), name=f"stream-{self.peer}-{msg.stream}"
        )
        self.streams[msg.stream] = stream
        if stream.record is not None:
            self.server.resumable[msg.request_id] = stream
        self.server.stream_opened()
        stream.task.add_done_callback(functools.partial(_stream_done, self.server, stream))

    async def _run_stream(
        self, stream: _Stream, request: GenerateRequest, before: asyncio.Task[None] | None = None
    ) -> None:
        # Frames go to the stream's connection of the moment: none while it
        # is an orphan, another proxy's once one has attached it.
        bound = self.log.bind(stream=stream.id, request_id=request.request_id)
        record = stream.record
        if before is not None:
            await asyncio.gather(before, return_exceptions=True)  # its engine request aborted
        try:
            async with contextlib.aclosing(self.server.engine.generate(request)) as deltas:
                async for delta in deltas:
                    if record is not None:
                        record.add(delta)
                    conn = stream.conn
                    if conn is None:
                        continue
                    try:
                        if delta.prompt is not None:
                            await conn.send(delta.prompt.to_frame(stream.id))
                        await conn.send(delta.to_frame(stream.id))
                    except ConnectionError:
                        if record is None:
                            raise
                        # Its proxy died while this waited on its socket: the
                        # record has the delta, and the connection's close
                        # orphans the request (or aborts it). It decodes on.
        except WorkerError as exc:
            bound.info("stream_failed", code=exc.code.value, error=str(exc))
            if record is not None:
                record.finish_reason = "error"
            if stream.conn is not None:
                await stream.conn.send(error_frame(stream.id, exc))
        except (ConnectionError, asyncio.CancelledError):
            raise
        except Exception as exc:  # a worker bug: tell the proxy, keep serving others
            bound.exception("stream_crashed")
            if record is not None:
                record.finish_reason = "error"
            if stream.conn is not None:
                text = f"{type(exc).__name__}: {exc}"
                await stream.conn.send(Error(stream.id, ErrorCode.INTERNAL.value, text))

    def _on_attach(self, msg: Attach) -> None:
        """Take over a resumable request: answer Attached, then its tokens on ``msg.stream``."""
        stream = self.server.resumable.get(msg.request_id)
        if stream is None or stream.record is None:
            ended = self.server.ended.get(msg.request_id)
            if ended is not None:  # its proxy died before its client had the end, or the move
                self._attached(msg, ended, released=ended.released)
                return
            text = f"request {msg.request_id} is not held here"
            self.write(Error(msg.stream, ErrorCode.UNKNOWN_REQUEST.value, text))
            return
        if msg.stream in self.streams:
            text = f"stream {msg.stream} is already open"
            self.write(Error(msg.stream, ErrorCode.DUPLICATE_STREAM.value, text))
            return
        old = stream.conn
        if old is not None and old is not self:
            old.streams.pop(stream.id, None)
            text = f"request {msg.request_id} was attached by another proxy"
            old.write(Error(stream.id, ErrorCode.MOVED.value, text))
        elif old is self:
            self.streams.pop(stream.id, None)
        self.server.orphans.release(msg.request_id)
        stream.conn, stream.id = self, msg.stream
        self._attached(msg, stream.record, moved=old is not None and old is not self)
        if stream.task.done():
            self.server.resumable.pop(msg.request_id, None)  # its end is in the Attached
        else:
            self.streams[msg.stream] = stream

    def _attached(self, msg: Attach, record: Record, **said: bool) -> None:
        """Answer ``msg`` with ``record`` (what it holds of the request), and log it."""
        self.write(record.attached(msg.stream))
        self.log.info(
            "request_attached", request_id=msg.request_id, stream=msg.stream,
            tokens=len(record.outputs), ended=record.ended, **said,
        )  # fmt: skip

    def _on_abort(self, stream_id: int) -> None:
        stream = self.streams.get(stream_id)
        if stream is None:
            return  # already finished: the final frame crossed the Abort
        stream.state = next_state(stream.state, StreamEvent.ABORT)
        stream.task.cancel(f"abort of stream {stream_id}")

    def _on_release(self, msg: Release) -> None:
        stream = self.streams.get(msg.stream)
        if stream is None:
            self.write(
                Error(
                    msg.stream, ErrorCode.UNKNOWN_STREAM.value, f"stream {msg.stream} is not open"
                )
            )
            return
        if stream.state is not StreamState.RUNNING:
            return  # already releasing or aborting
        stream.state = next_state(stream.state, StreamEvent.RELEASE)
        task = asyncio.create_task(
            self._release(stream, msg.migration), name=f"release-{msg.stream}"
        )
        self.server.track(task)

    async def _release(self, stream: _Stream, migration: str) -> None:
        try:
            info = await self.server.engine.release(stream.request_id, migration)
        except WorkerError as exc:
            # The stream goes on: an Error answering a Release does not end it.
            if stream.state is StreamState.RELEASING:
                stream.state = next_state(stream.state, StreamEvent.REFUSE)
                await self.send(error_frame(stream.id, exc))
            return
        # The released stream's task may end (RELEASING -> CLOSED) before this runs.
        if stream.state in (StreamState.RELEASING, StreamState.CLOSED):
            if stream.state is StreamState.RELEASING:
                stream.state = next_state(stream.state, StreamEvent.HANDOFF)
            if stream.record is not None:
                stream.record.released = True
                if stream.task.done():  # ended before the engine said released
                    self.server.keep_ended(stream.record)
            if stream.conn is None:
                return  # an orphan: an Attach says released, its proxy continues it elsewhere
            await stream.conn.send(
                Handoff(
                    stream=stream.id,
                    migration=migration,
                    kv_transfer_params=info.kv_transfer_params,
                    num_tokens=info.num_tokens,
                    fusion=info.fusion,
                )
            )

    # -- closing ------------------------------------------------------------------

    async def cancel_streams(self, reason: str) -> None:
        """Cancel every open stream (aborting its request) and wait for them.

        A resumable one is orphaned instead while ``orphan_grace_s`` allows
        (the worker is not shutting down): it runs on, for another proxy to attach.
        """
        server = self.server
        if server.orphans.grace_s > 0 and not server.draining:
            for s in list(self.streams.values()):
                if s.record is not None and s.state is not StreamState.ABORTING:
                    del self.streams[s.id]
                    s.conn = None
                    server.orphans.hold(s.request_id)
                    self.log.info(
                        "request_orphaned", request_id=s.request_id, grace_s=server.orphans.grace_s
                    )
        tasks = [s.task for s in self.streams.values()]
        for s in list(self.streams.values()):
            if s.state is not StreamState.ABORTING:
                s.state = next_state(s.state, StreamEvent.ABORT)
            s.task.cancel(reason)
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)

    async def close(self) -> None:
        """Abort what is left, then close the socket (idempotent)."""
        if self.closing:
            return
        self.closing = True
        watcher, self.watch, self.beat = self.watch, None, None
        if watcher is not None and watcher is not asyncio.current_task():
            watcher.cancel()
        await self.cancel_streams("the proxy went silent" if self.silent else "connection closed")
        self.writer.close()
        with contextlib.suppress(ConnectionError, OSError):
            await self.writer.wait_closed()
        self.log.info("connection_closed")


def _stream_done(server: TokenServer, stream: _Stream, task: asyncio.Task[None]) -> None:
    """A stream's task ended: its connection (if any) acknowledges an Abort and forgets it."""
    server.stream_closed()
    conn = stream.conn
    aborted = stream.state is StreamState.ABORTING
    if stream.state is not StreamState.CLOSED:  # a Handoff may have closed it first
        stream.state = next_state(stream.state, StreamEvent.FINISH)
    if conn is None:
        return  # an orphan: kept (resumable, ended) until attached or its grace runs out
    conn.streams.pop(stream.id, None)
    if server.resumable.get(stream.request_id) is stream:
        del server.resumable[stream.request_id]  # its proxy had every frame, but:
        if stream.record is not None and not aborted:
            server.keep_ended(stream.record)
    if task.cancelled():
        if aborted:
            # Acknowledge the Abort so the proxy can forget the stream.
            conn.write(Tokens(stream=stream.id, token_ids=[], finish_reason="abort"))
        return
    exc = task.exception()
    if exc is not None and not isinstance(exc, ConnectionError):
        conn.log.error("stream_task_failed", stream=stream.id, error=repr(exc))


class InsecureBind(ValueError):
    """A token server without a cluster secret asked to listen beyond loopback."""


def check_bind(host: str, secret: str) -> None:
    """Refuse an unauthenticated token protocol on an address other hosts can reach."""
    if not secret and not handshake.is_loopback(host):
        raise InsecureBind(
            f"worker.host={host} opens the token protocol beyond loopback without "
            "authentication: set cluster.secret (STAR_CLUSTER_SECRET), the same on "
            "every worker and proxy of the cluster"
        )


class TokenServer:
    """Serve the internal token protocol for one engine.

    ``hello`` is sent first on every connection; with ``secret`` (the
    ``cluster.secret`` setting) only after the peer has passed the handshake
    of :mod:`star.handshake`. Without one, ``host`` must be a loopback
    address (:func:`check_bind`). ``port=0`` picks a free port;
    :attr:`address` says which after :meth:`start`. ``sock``, a socket already
    listening (:func:`star.ports.listen`), is served instead of binding one. :meth:`serve` runs until
    :meth:`shutdown`, which stops intake, lets open streams finish for up to
    ``drain_timeout`` seconds, then aborts the rest and closes connections.
    ``liveness_timeout_s`` (``cluster.liveness_timeout_s``; 0: off): a
    connection whose proxy has sent a Ping and then nothing for that long is
    closed, its streams aborted.
    """

    def __init__(
        self,
        engine: Engine,
        hello: Hello,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        max_frame: int = MAX_FRAME_BYTES,
        sock: socket.socket | None = None,
        secret: str = "",
        handshake_timeout_s: float = handshake.TIMEOUT_S,
        liveness_timeout_s: float = DEFAULT_TIMEOUT_S,
        orphan_grace_s: float = 0.0,
    ) -> None:
        check_bind(host, secret)
        self.engine = engine
        self.hello = hello
        self.host = host
        self.port = port
        self.sock = sock  # already bound and listening (the port kept since startup)
        self.max_frame = max_frame
        self.key = handshake.secret_key(secret) if secret else None
        self.handshake_timeout_s = handshake_timeout_s
        # cluster.liveness_timeout_s: drop a proxy silent this long (0: never).
        self.liveness_timeout_s = liveness_timeout_s
        self.refused = 0  # peers that failed the handshake
        # Resumable requests by id, while a proxy may still attach them; those
        # whose proxy went away are held orphan_grace_s (worker.orphan_grace_s).
        self.resumable: dict[str, _Stream] = {}
        self.orphans = Orphans(orphan_grace_s, self._orphan_expired)
        # Records of resumable requests whose stream ended here (finished, or
        # released for a migration), kept as long: their proxy had every frame
        # but may die before its client has them, or before it opened a move's
        # target leg; an Attach then answers with the end, or with released.
        self.ended: dict[str, Record] = {}
        self._ended_timers = Orphans(orphan_grace_s, self._ended_expired)
        self.draining = False
        self.stream_count = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self._server: asyncio.Server | None = None
        self._connections: set[_Connection] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        self._closed = asyncio.Event()

    @property
    def address(self) -> str:
        """``host:port`` the server listens on (after :meth:`start`)."""
        return f"{self.host}:{self.port}"

    @property
    def connections(self) -> int:
        return len(self._connections)

    def note_refused(self, peer: str, reason: str) -> None:
        """Log and count a peer that failed the handshake."""
        self.refused += 1
        log.warning("peer_refused", peer=peer, reason=reason, refused=self.refused)

    def stream_opened(self) -> None:
        self.stream_count += 1
        self._idle.clear()

    def stream_closed(self) -> None:
        self.stream_count -= 1
        if not self.stream_count:
            self._idle.set()

    async def wait_idle(self) -> None:
        """Wait until no stream is open on any connection."""
        await self._idle.wait()

    def drop_orphan(self, request_id: str) -> asyncio.Task[None] | None:
        """Abort ``request_id`` if it is an orphan here; its task (None: it is not one)."""
        stream = self.resumable.get(request_id)
        if stream is None or stream.conn is not None:
            return None
        self.orphans.release(request_id)
        self._orphan_expired(request_id)
        return stream.task

    def keep_ended(self, record: Record) -> None:
        """Keep the record of a request that ended here for an Attach (``worker.orphan_grace_s``)."""
        if record.ended and self._ended_timers.grace_s > 0 and not self.draining:
            self.ended[record.request_id] = record
            self._ended_timers.hold(record.request_id)

    def _ended_expired(self, request_id: str) -> None:
        self.ended.pop(request_id, None)

    def _orphan_expired(self, request_id: str) -> None:
        """No proxy attached the orphan in time: abort it (its KV is freed), forget it."""
        stream = self.resumable.pop(request_id, None)
        if stream is None or stream.conn is not None:
            return
        log.info("orphan_aborted", request_id=request_id, ended=stream.task.done())
        if not stream.task.done():
            if stream.state is not StreamState.ABORTING:
                stream.state = next_state(stream.state, StreamEvent.ABORT)
            stream.task.cancel("orphan not attached in time")

    def track(self, task: asyncio.Task[None]) -> None:
        """Own a helper task until it ends (no orphans)."""
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def start(self) -> None:
        """Bind and start accepting connections."""
        if self.sock is not None:
            self._server = await asyncio.start_server(self._accept, sock=self.sock)
        else:
            self._server = await asyncio.start_server(self._accept, self.host, self.port)
        sock = self._server.sockets[0].getsockname()
        self.port = int(sock[1])
        log.info("token_server_listening", address=self.address)

    async def serve(self) -> None:
        """Start (if needed) and run until :meth:`shutdown`."""
        if self._server is None:
            await self.start()
        await self._closed.wait()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conn = _Connection(self, reader, writer)
        if self.draining:
            if self.key is not None:  # an unproven peer is told nothing
                await conn.close()
                return
            conn.write(error_frame(CONNECTION_STREAM, ShuttingDown("the worker is shutting down")))
            await conn.close()
            return
        self._connections.add(conn)
        conn.log.info("connection_opened")
        try:
            await conn.run()
        finally:
            self._connections.discard(conn)

    async def shutdown(self, drain_timeout: float = 30.0) -> None:
        """Stop intake, drain open streams for up to ``drain_timeout`` s, then close."""
        self.draining = True
        if self._server is not None:
            self._server.close()
        with contextlib.suppress(TimeoutError):
            async with deadline(drain_timeout):
                await self._idle.wait()
        if self.stream_count:
            log.warning("drain_timed_out_aborting_streams", streams=self.stream_count)
        for request_id in self.orphans.clear():
            self._orphan_expired(request_id)
        self._ended_timers.clear()
        self.ended.clear()
        for conn in list(self._connections):
            await conn.close()
        for task in list(self._tasks):
            task.cancel("token server shutdown")
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()
        self._closed.set()
