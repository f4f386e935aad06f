"""The proxy's side of the internal token protocol: one multiplexed connection per worker.

A :class:`WorkerClient` owns one TCP connection to a worker, proves the
cluster secret and checks the worker's proof when it has one
(:mod:`star.handshake`; no request goes to a worker that has not proved it),
reads the worker's :class:`~star.wire.Hello`, then routes every incoming frame to the
:class:`Stream` it belongs to. Many requests share the connection; each has
its own stream id. When the connection breaks, every open stream gets a
:class:`ConnectionLost` and the next :meth:`WorkerPool.get` reconnects.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import Awaitable, Callable

import structlog

from star.aio import deadline
from star.handshake import HandshakeFailed, ProxyHandshake, secret_key
from star.wire import Challenge, Error, FrameDecoder, Hello, Message, WireError, frame

log = structlog.get_logger(__name__)


class ConnectionLost(Exception):
    """The worker connection closed while a stream was open."""


class AuthFailed(ConnectionLost):
    """The worker and this proxy do not share the cluster secret (or it is an impostor)."""


class Stream:
    """Frames of one stream, in order."""

    def __init__(self, client: WorkerClient, stream_id: int) -> None:
        self.client = client
        self.id = stream_id
        self._queue: asyncio.Queue[Message | BaseException] = asyncio.Queue()

    def put(self, item: Message | BaseException) -> None:
        self._queue.put_nowait(item)

    async def next(self) -> Message:
        """The next frame of this stream; raises :class:`ConnectionLost`."""
        item = await self._queue.get()
        if isinstance(item, BaseException):
            raise item
        return item

    async def send(self, msg: Message) -> None:
        """Send a frame on this stream's connection; raises :class:`ConnectionLost`."""
        await self.client.send(msg)

    def close(self) -> None:
        self.client.forget(self.id)


class WorkerClient:
    """One connection to a worker; frames are routed by ``stream``."""

    def __init__(self, address: str, secret: str = "") -> None:
        self.address = address
        self._key = secret_key(secret) if secret else None
        self.hello: Hello | None = None
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._streams: dict[int, Stream] = {}
        self._ids = itertools.count(1)
        self._task: asyncio.Task[None] | None = None
        self.closed = False

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
            while not pending:
                data = await reader.read(65536)
                if not data:
                    raise ConnectionLost(f"worker {self.address} closed before {before}")
                decoder.feed(data)
                try:
                    pending.extend(decoder)
                except WireError as exc:
                    raise ConnectionLost(
                        f"worker {self.address} sent a bad frame instead of {before}: {exc}"
                    ) from exc
            return pending.pop(0)

        try:
            # One deadline for the whole Hello: a worker that trickles bytes
            # cannot hold the connect open for longer.
            async with deadline(timeout_s):
                first = await next_frame("Hello")
                if self._key is not None:
                    await self._authenticate(first, next_frame)
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
        return self.hello

    async def _authenticate(
        self, first: Message, next_frame: Callable[[str], Awaitable[Message]]
    ) -> None:
        """The proxy's side of the handshake; raises :class:`AuthFailed`."""
        assert self._key is not None and self._writer is not None
        shake = ProxyHandshake(self._key)
        try:
            self._writer.write(frame(shake.on_challenge(first)))
            await self._writer.drain()
            try:
                accept = await next_frame("accepting")
            except ConnectionLost:
                raise AuthFailed(
                    f"worker {self.address} refused this proxy: is cluster.secret the same on both?"
                ) from None
            shake.on_accept(accept)
        except HandshakeFailed as exc:
            raise AuthFailed(
                f"worker {self.address} failed authentication ({exc.reason}): {exc}"
            ) from None

    async def _abandon(self) -> None:
        """Close a connection whose Hello never came (the caller sees why)."""
        self.closed = True
        writer, self._writer, self._reader = self._writer, None, None
        if writer is not None:
            writer.close()  # the transport closes even if this wait is cancelled
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    def open(self) -> Stream:
        stream = Stream(self, next(self._ids))
        self._streams[stream.id] = stream
        return stream

    def forget(self, stream_id: int) -> None:
        self._streams.pop(stream_id, None)

    async def send(self, msg: Message) -> None:
        if self.closed or self._writer is None:
            raise ConnectionLost(f"connection to {self.address} is closed")
        self._writer.write(frame(msg))
        try:
            await self._writer.drain()
        except (ConnectionError, OSError) as exc:
            raise ConnectionLost(f"connection to {self.address} broke: {exc}") from exc

    def _route(self, msg: Message) -> None:
        stream_id = getattr(msg, "stream", None)
        if isinstance(msg, Error) and msg.stream < 0:
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
        reason = "closed by the worker"
        try:
            for msg in pending:
                self._route(msg)
            while True:
                data = await self._reader.read(1 << 16)
                if not data:
                    break
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
        except (ConnectionError, OSError) as exc:
            reason = str(exc)
        finally:
            self.closed = True
            lost = ConnectionLost(f"connection to worker {self.address} lost: {reason}")
            for stream in list(self._streams.values()):
                stream.put(lost)
            self._streams.clear()

    async def close(self) -> None:
        self.closed = True
        if self._writer is not None:
            self._writer.close()
            with contextlib.suppress(Exception):
                await self._writer.wait_closed()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task


class WorkerPool:
    """Connections by address, (re)opened on demand."""

    def __init__(self, secret: str = "") -> None:
        self.secret = secret  # cluster.secret: every connection proves it
        self._clients: dict[str, WorkerClient] = {}
        self._locks: dict[str, asyncio.Lock] = {}

    async def get(self, address: str) -> WorkerClient:
        client = self._clients.get(address)
        if client is not None and not client.closed:
            return client
        lock = self._locks.setdefault(address, asyncio.Lock())
        async with lock:
            client = self._clients.get(address)
            if client is not None and not client.closed:
                return client
            client = WorkerClient(address, self.secret)
            await client.connect()
            self._clients[address] = client
            log.info(
                "connected_to_worker",
                address=address,
                instance=client.hello.instance if client.hello else "?",
            )
            return client

    async def close(self) -> None:
        for client in list(self._clients.values()):
            await client.close()
        self._clients.clear()
