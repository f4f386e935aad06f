"""The proxy's side of the internal token protocol: one multiplexed connection per worker.

A :class:`WorkerClient` owns one TCP connection to a worker, proves the
cluster secret and checks the worker's proof when it has one
(:mod:`star.handshake`; no request goes to a worker that has not proved it),
reads the worker's :class:`~star.wire.Hello`, then routes every incoming frame to the
:class:`Stream` it belongs to. Many requests share the connection; each has
its own stream id. When the connection breaks, every open stream gets a
:class:`ConnectionLost` and the next :meth:`WorkerPool.get` reconnects.

A worker that goes silent counts as a broken connection
(``cluster.liveness_timeout_s``, :mod:`star.liveness`): the client sends a
Ping right after Hello and whenever nothing has come in for a quarter of the
bound, answers the worker's Pings, and drops a connection with nothing
received for the whole bound. An older worker answers that first Ping with a
``bad_frame`` Error: the client then sends no more and checks nothing on that
connection. :class:`WorkerPool` then holds off reconnecting to a worker that
went silent or let a connect time out (:meth:`WorkerPool.get` fails at once
until the back-off ends), so the dispatch passes over it without waiting.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import structlog

from star.aio import deadline
from star.handshake import Channel, ChannelBroken, HandshakeFailed, ProxyHandshake, secret_key
from star.liveness import ALONE_BOUNDS, DEFAULT_TIMEOUT_S, Heartbeat, may_drop, watch
from star.wire import (
    Challenge,
    Error,
    ErrorCode,
    FrameDecoder,
    Hello,
    Message,
    Ping,
    Pong,
    WireError,
    frame,
)

log = structlog.get_logger(__name__)


class ConnectionLost(Exception):
    """The worker connection closed (or went silent) while a stream was open."""


class AuthFailed(ConnectionLost):
    """The worker and this proxy do not share the cluster secret (or it is an impostor)."""


class Stream:
    """Frames of one stream, in order.

    A stream whose frames came faster than its consumer relays them (a burst
    after this proxy was starved of CPU, a worker outpacing the relay) holds a
    backlog that ``next`` hands out without suspending: the consumer would
    relay all of it in one go, and the event loop (every other stream, the
    liveness Pongs a worker waits for) would wait meanwhile, seconds for a
    long backlog. So ``next`` lets the loop run once every
    :attr:`YIELD_EVERY` frames taken without waiting.
    """

    YIELD_EVERY = 32

    def __init__(self, client: WorkerClient, stream_id: int) -> None:
        self.client = client
        self.id = stream_id
        self._queue: asyncio.Queue[Message | BaseException] = asyncio.Queue()
        self._unbroken = 0  # frames taken in a row without waiting

    def put(self, item: Message | BaseException) -> None:
        self._queue.put_nowait(item)

    async def next(self) -> Message:
        """The next frame of this stream; raises :class:`ConnectionLost`."""
        if self._queue.empty():
            self._unbroken = 0
        else:
            self._unbroken += 1
            if self._unbroken >= self.YIELD_EVERY:
                self._unbroken = 0
                await asyncio.sleep(0)  # the backlog stays: only this task takes from it
        item = await self._queue.get()
        if isinstance(item, BaseException):
            raise item
        return item

    async def send(self, msg: Message) -> None:
        """Send a frame on this stream's connection; raises :class:`ConnectionLost`."""
        await self.client.send(msg)

    def close(self) -> None:
        self.client.forget(self.id)


def _refuses_ping(msg: Error) -> bool:
    """An older worker's answer to a Ping: the kind is unknown to its decoder."""
    return msg.code == ErrorCode.BAD_FRAME and "'ping'" in msg.message


class WorkerClient:
    """One connection to a worker; frames are routed by ``stream``.

    ``liveness_timeout_s`` (``cluster.liveness_timeout_s``; 0: off): drop
    the connection when nothing has come from the worker for that long;
    ``on_silent(address)`` is called when it does.
    """

    def __init__(
        self,
        address: str,
        secret: str = "",
        liveness_timeout_s: float = DEFAULT_TIMEOUT_S,
        on_silent: Callable[[str], None] | None = None,
        others_silent: Callable[[WorkerClient], list[float]] | None = None,
    ) -> None:
        self.address = address
        self._key = secret_key(secret) if secret else None
        self.hello: Hello | None = None
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._streams: dict[int, Stream] = {}
        self._ids = itertools.count(1)
        self._task: asyncio.Task[None] | None = None
        self.closed = False
        self.liveness_timeout_s = liveness_timeout_s
        self._on_silent = on_silent
        # How long each other connection of this proxy has heard nothing (star.liveness.may_drop).
        self._others_silent = others_silent
        self._waited = False  # a drop declined (every connection silent): logged once
        self._beat: Heartbeat | None = None  # None: not checked (off, or an older worker)
        self._watch: asyncio.Task[None] | None = None
        self.silent = ""  # why the connection was dropped as silent ("" while it was not)
        self._seal: Callable[[bytes], bytes] | None = None  # the channel, after the handshake

    async def connect(self, timeout_s: float = 5.0) -> Hello:
        """Open the connection and read the worker's Hello, within ``timeout_s``.

        With a secret, the handshake comes first and counts toward the same
        deadline. Raises ``OSError`` (refused), ``TimeoutError`` (no
        connection or no Hello in time), :class:`AuthFailed` (no shared
        secret) or :class:`ConnectionLost` (closed, or not a Hello first).
        On any failure, cancellation included, the socket is closed.
        """
        host, _, port = self.address.rpartition(":")
        async with deadline(timeout_s):
            reader, self._writer = await asyncio.open_connection(host, int(port))
        self._reader = reader
        decoder = FrameDecoder()
        pending: list[Message] = []

        async def next_frame(before: str) -> Message:
            # One frame at a time: the ones after the Accept are sealed, and the
            # decoder learns to open them only once the Accept has been checked.
            while True:
                try:
                    msg = next(decoder, None)
                except (WireError, ChannelBroken) as exc:
                    raise ConnectionLost(
                        f"worker {self.address} sent a bad frame instead of {before}: {exc}"
                    ) from exc
                if msg is not None:
                    return msg
                data = await reader.read(65536)
                if not data:
                    raise ConnectionLost(f"worker {self.address} closed before {before}")
                decoder.feed(data)

        try:
            # One deadline for the whole Hello: a worker that trickles bytes
            # cannot hold the connect open for longer.
            async with deadline(timeout_s):
                first = await next_frame("Hello")
                if self._key is not None:
                    decoder.opener = await self._authenticate(first, next_frame)
                    first = await next_frame("Hello")
                elif isinstance(first, Challenge):
                    raise AuthFailed(
                        f"worker {self.address} requires authentication: set cluster.secret "
                        "(STAR_CLUSTER_SECRET) to the cluster's secret"
                    )
            if not isinstance(first, Hello):
                raise ConnectionLost(
                    f"worker {self.address} did not start with Hello (got {first.KIND})"
                )
        except TimeoutError as exc:
            await self._abandon()
            raise TimeoutError(f"worker {self.address} sent no Hello within {timeout_s}s") from exc
        except BaseException:
            await self._abandon()
            raise
        self.hello = first
        self._task = asyncio.create_task(
            self._read(decoder, pending), name=f"upstream {self.address}"
        )
        if self.liveness_timeout_s > 0:
            now = asyncio.get_running_loop().time()
            beat = self._beat = Heartbeat(self.liveness_timeout_s, now)
            # The first Ping at once: it tells the worker this proxy checks
            # liveness (it starts its own check), and an older worker's refusal
            # says not to.
            self._write(Ping(beat.pinged(now)))
            self._watch = asyncio.create_task(
                watch(beat, self._ping, self._silent), name=f"liveness {self.address}"
            )
        return self.hello

    async def _authenticate(
        self, first: Message, next_frame: Callable[[str], Awaitable[Message]]
    ) -> Callable[[bytes], bytes]:
        """The proxy's side of the handshake; the channel's opener for every later frame
        (the channel's sealer is kept for writing). Raises :class:`AuthFailed`."""
        assert self._key is not None and self._writer is not None
        shake = ProxyHandshake(self._key, self.address)
        try:
            self._writer.write(frame(shake.on_challenge(first)))
            await self._writer.drain()
            try:
                accept = await next_frame("accepting")
            except ConnectionLost:
                raise AuthFailed(
                    f"worker {self.address} refused this proxy: is cluster.secret the same on "
                    "both, and is this the address the worker reports?"
                ) from None
            shake.on_accept(accept)
        except HandshakeFailed as exc:
            raise AuthFailed(
                f"worker {self.address} failed authentication ({exc.reason}): {exc}"
            ) from None
        channel = Channel(shake.session, "proxy")
        self._seal = channel.seal
        return channel.open

    async def _abandon(self) -> None:
        """Close a connection whose Hello never came (the caller sees why)."""
        self.closed = True
        writer, self._writer, self._reader = self._writer, None, None
        if writer is not None:
            writer.close()  # the transport closes even if this wait is cancelled
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    @property
    def usable(self) -> bool:
        """Open, its transport too: the worker's close (it dropped this proxy as silent) can
        close the transport before the reader task has seen EOF and set ``closed``."""
        return not self.closed and self._writer is not None and not self._writer.is_closing()

    def open(self) -> Stream:
        stream = Stream(self, next(self._ids))
        self._streams[stream.id] = stream
        return stream

    def forget(self, stream_id: int) -> None:
        self._streams.pop(stream_id, None)

    async def send(self, msg: Message) -> None:
        writer = self._writer
        if not self.usable or writer is None:
            raise ConnectionLost(self.silent or f"connection to {self.address} is closed")
        data = frame(msg, self._seal)
        try:
            writer.write(data)
            await writer.drain()
        except (ConnectionError, OSError, RuntimeError) as exc:
            # uvloop raises RuntimeError ("unable to perform operation on
            # <TCPTransport closed=True ...>") writing to a closed transport.
            raise ConnectionLost(
                self.silent or f"connection to {self.address} broke: {exc}"
            ) from exc

    # -- liveness -----------------------------------------------------------------------

    def _write(self, msg: Message) -> None:
        """Queue a small connection frame (Ping, Pong) without waiting for the socket."""
        if not self.closed and self._writer is not None and not self._writer.is_closing():
            self._writer.write(frame(msg, self._seal))

    def _ping(self, seq: int) -> None:
        self._write(Ping(seq))

    def silent_for(self, now: float) -> float | None:
        """Seconds since the worker was last heard (None: not checked, or closed)."""
        if self._beat is None or self.closed:
            return None
        return self._beat.silent_for(now)

    def _silent(self, silent_s: float) -> bool:
        """Nothing from the worker for the whole bound: drop the connection as lost, unless
        every other worker is as silent (:func:`star.liveness.may_drop`): then wait."""
        others = self._others_silent(self) if self._others_silent is not None else ()
        if not may_drop(silent_s, self.liveness_timeout_s, others):
            if not self._waited:
                self._waited = True
                log.warning(
                    "worker_silent_with_every_other_waiting",
                    address=self.address,
                    silent_s=round(silent_s, 3),
                    others_silent_s=[round(s, 3) for s in others],
                    drop_after_s=self.liveness_timeout_s * ALONE_BOUNDS,
                )
            return False
        self.silent = (
            f"connection to worker {self.address} lost: nothing received for "
            f"{silent_s:.2f}s (cluster.liveness_timeout_s={self.liveness_timeout_s:g})"
        )
        log.warning(
            "worker_silent_connection_dropped",
            address=self.address,
            silent_s=round(silent_s, 3),
            streams=len(self._streams),
        )
        self.closed = True
        if self._writer is not None:
            # No FIN handshake with a peer that does not answer: the reader
            # sees EOF at once and hands every stream its ConnectionLost.
            self._writer.transport.abort()
        if self._on_silent is not None:
            self._on_silent(self.address)
        return True

    def _stop_watch(self) -> None:
        self._beat = None
        watcher, self._watch = self._watch, None
        if watcher is not None and watcher is not asyncio.current_task():
            watcher.cancel()

    def _route(self, msg: Message) -> None:
        if isinstance(msg, Ping):
            self._write(Pong(msg.seq))
            return
        if isinstance(msg, Pong):
            return  # its bytes were proof enough
        stream_id = getattr(msg, "stream", None)
        if isinstance(msg, Error) and msg.stream < 0:
            if self._beat is not None and _refuses_ping(msg):
                self._stop_watch()
                log.info(
                    "worker_without_heartbeats",
                    address=self.address,
                    detail="an older worker: no liveness check on this connection",
                )
                return
            log.warning(
                "worker_connection_error",
                address=self.address,
                code=msg.code,
                error=msg.message,
            )
            return
        target = self._streams.get(stream_id) if isinstance(stream_id, int) else None
        if target is not None:
            target.put(msg)

    async def _read(self, decoder: FrameDecoder, pending: list[Message]) -> None:
        assert self._reader is not None
        clock = asyncio.get_running_loop().time
        reason = "closed by the worker"
        try:
            for msg in pending:
                self._route(msg)
            while True:
                data = await self._reader.read(1 << 16)
                if not data:
                    break
                beat = self._beat
                if beat is not None:
                    beat.last_received = clock()
                decoder.feed(data)
                while True:
                    try:
                        msg = next(decoder)
                    except StopIteration:
                        break
                    except WireError as exc:
                        log.warning(
                            "undecodable_frame_from_worker", address=self.address, error=str(exc)
                        )
                        continue
                    self._route(msg)
        except ChannelBroken as exc:  # altered or injected on the way: drop the connection
            log.warning("frame_failed_authentication", address=self.address, error=str(exc))
            reason = str(exc)
        except (ConnectionError, OSError) as exc:
            reason = str(exc)
        finally:
            self.closed = True
            self._stop_watch()
            lost = ConnectionLost(
                self.silent or f"connection to worker {self.address} lost: {reason}"
            )
            for stream in list(self._streams.values()):
                stream.put(lost)
            self._streams.clear()

    async def close(self) -> None:
        self.closed = True
        self._stop_watch()
        if self._writer is not None:
            self._writer.close()
            with contextlib.suppress(Exception):
                await self._writer.wait_closed()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task


@dataclass(slots=True)
class _Backoff:
    until: float  # monotonic: no connect attempt before
    failures: int  # in a row
    why: str
    attempt: asyncio.Task[None] | None = None  # the retry under way, off any request's path


class WorkerPool:
    """Connections by address, (re)opened on demand.

    ``liveness_timeout_s`` (``cluster.liveness_timeout_s``; 0: off) is each
    connection's liveness bound and, when set, the bound of a connect (TCP,
    handshake, Hello) too, unless ``connect_timeout_s`` is given (5 s with
    liveness off). A worker that went silent, or whose connect timed out, is
    unreachable for the bound, doubling per failure in a row up to
    ``BACKOFF_MAX_BOUNDS`` bounds; meanwhile :meth:`get` raises
    :class:`ConnectionLost` at once (the caller marks the instance down and
    goes elsewhere). The first :meth:`get` after that starts one connect
    attempt in the background and fails at once too: no request waits on a
    worker that went silent. A refused connection costs nothing and backs off
    nothing (the caller marks the instance down for a moment).
    """

    BACKOFF_MAX_BOUNDS = 4

    def __init__(
        self,
        secret: str = "",
        liveness_timeout_s: float = DEFAULT_TIMEOUT_S,
        connect_timeout_s: float | None = None,
    ) -> None:
        self.secret = secret  # cluster.secret: every connection proves it
        self.liveness_timeout_s = liveness_timeout_s
        if connect_timeout_s is None:
            connect_timeout_s = liveness_timeout_s if liveness_timeout_s > 0 else 5.0
        self.connect_timeout_s = connect_timeout_s
        self._clients: dict[str, WorkerClient] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        self._backoff: dict[str, _Backoff] = {}

    def backing_off(self, address: str) -> float | None:
        """Seconds before the next connect attempt to ``address``; None: reachable as far as known."""
        b = self._backoff.get(address)
        return max(0.0, b.until - time.monotonic()) if b is not None else None

    def _failed(self, address: str, why: str) -> None:
        """A connect that failed after a silence, or timed out, or a connection
        dropped as silent: unreachable for a while."""
        b = self._backoff.get(address)
        failures = b.failures + 1 if b is not None else 1
        base = self.liveness_timeout_s if self.liveness_timeout_s > 0 else self.connect_timeout_s
        delay = min(base * 2 ** (failures - 1), base * self.BACKOFF_MAX_BOUNDS)
        self._backoff[address] = _Backoff(time.monotonic() + delay, failures, why)
        log.warning(
            "worker_unreachable_backing_off",
            address=address,
            why=why,
            retry_in_s=delay,
            failures=failures,
        )

    def _on_silent(self, address: str) -> None:
        self._failed(address, "it went silent")

    def _others_silent(self, client: WorkerClient) -> list[float]:
        """How long each other open connection has heard nothing from its worker."""
        now = asyncio.get_running_loop().time()
        out = []
        for other in self._clients.values():
            if other is not client and (s := other.silent_for(now)) is not None:
                out.append(s)
        return out

    async def get(self, address: str) -> WorkerClient:
        """The open connection to ``address``, or a new one (ConnectionLost while it backs off).

        One whose transport the worker closed is replaced at once, before its
        reader has noticed: a recovery after a worker dropped this proxy (as
        silent, when its loop ran late) then reaches that worker again instead
        of failing on the stale connection (a chaos run's unfaulted row lost a
        stream so when both decode workers dropped a starved proxy at once).
        """
        client = self._clients.get(address)
        if client is not None and client.usable:
            return client
        b = self._backoff.get(address)
        if b is not None:
            wait = b.until - time.monotonic()
            if wait <= 0 and b.attempt is None:
                b.attempt = asyncio.create_task(self._retry(address), name=f"reconnect {address}")
            when = f"next connect attempt in {wait:.1f}s" if wait > 0 else "reconnecting"
            raise ConnectionLost(f"worker {address} unreachable ({b.why}): {when}")
        async with self._locks.setdefault(address, asyncio.Lock()):
            client = self._clients.get(address)
            if client is not None and client.usable:
                return client
            if address in self._backoff:  # the connect this one waited for failed
                raise ConnectionLost(f"worker {address} unreachable ({self._backoff[address].why})")
            return await self._connect(address)

    async def _connect(self, address: str) -> WorkerClient:
        """Connect (the caller holds the address's lock); a timeout backs off."""
        client = WorkerClient(
            address, self.secret, self.liveness_timeout_s, self._on_silent, self._others_silent
        )
        try:
            await client.connect(self.connect_timeout_s)
        except TimeoutError:
            self._failed(address, f"no Hello within {self.connect_timeout_s:g}s")
            raise
        self._backoff.pop(address, None)
        self._clients[address] = client
        log.info(
            "connected_to_worker",
            address=address,
            instance=client.hello.instance if client.hello else "?",
        )
        return client

    async def _retry(self, address: str) -> None:
        """One connect attempt to a worker that is backing off, off any request's path."""
        async with self._locks.setdefault(address, asyncio.Lock()):
            try:
                await self._connect(address)
            except TimeoutError:
                pass  # backing off longer (_connect)
            except (OSError, ConnectionLost) as exc:
                self._failed(address, str(exc))
            except asyncio.CancelledError:
                raise
            except Exception:  # a bug: keep the address backing off, say why
                log.exception("worker_reconnect_failed", address=address)
                self._failed(address, "reconnect failed")

    async def close(self) -> None:
        attempts = [b.attempt for b in self._backoff.values() if b.attempt is not None]
        for task in attempts:
            task.cancel()
        await asyncio.gather(*attempts, return_exceptions=True)
        for client in list(self._clients.values()):
            await client.close()
        self._clients.clear()
