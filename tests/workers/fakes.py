"""A scripted engine for protocol tests, and a framed-msgpack test client."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from star.wire import FRAMES, Message, decode, frame
from workers.protocol import (
    BadRequest,
    GenerateRequest,
    HandoffInfo,
    TokenDelta,
    Unsupported,
)


@dataclass
class FakeEngine:
    """Streams ``sampling["max_tokens"]`` tokens (ids ``first_id``, +1, ...), one per ``step_s``
    (a true continuation of ``continued`` tokens: the rest of them, ids from ``first_id + continued``).

    ``sampling["fail"]`` makes the request fail with BadRequest after that many
    tokens. ``aborted`` lists request ids whose generator was closed or
    cancelled before finishing (what AsyncLLM turns into an engine abort).
    """

    step_s: float = 0.0
    first_id: int = 100
    started: list[str] = field(default_factory=list)
    aborted: list[str] = field(default_factory=list)
    finished: list[str] = field(default_factory=list)
    live: set[str] = field(default_factory=set)
    idle: asyncio.Event = field(default_factory=asyncio.Event)
    # With ``releases``, a Release holds the request's KV (as vLLM's does): its
    # stream ends at its next step without a finish; else it is unsupported.
    releases: bool = False
    released: set[str] = field(default_factory=set)

    async def generate(self, request: GenerateRequest) -> AsyncIterator[TokenDelta]:
        n = int(request.sampling.get("max_tokens", 4))
        fail = request.sampling.get("fail")
        self.started.append(request.request_id)
        self.live.add(request.request_id)
        self.idle.clear()
        done = False
        # A true continuation (``resume``): its continued tokens are outputs, so
        # they count toward max_tokens, and the ids go on from there.
        first = request.continued if request.resume else 0
        try:
            for i in range(first, n):
                if request.request_id in self.released:
                    done = True
                    return
                if fail is not None and i == fail:
                    raise BadRequest(f"scripted failure of {request.request_id}")
                await asyncio.sleep(self.step_s)
                last = i == n - 1
                yield TokenDelta(
                    token_ids=[self.first_id + i],
                    finish_reason="length" if last else None,
                    kv_transfer_params={"remote": request.request_id} if last else None,
                    num_prompt_tokens=len(request.prompt_token_ids),
                )
            done = True
            self.finished.append(request.request_id)
        finally:
            self.live.discard(request.request_id)
            if not self.live:
                self.idle.set()
            if not done:
                self.aborted.append(request.request_id)

    async def release(self, request_id: str, migration: str) -> HandoffInfo:
        if not self.releases:
            raise Unsupported("no D->D release in the fake")
        self.released.add(request_id)
        return HandoffInfo({"remote": request_id, "migration": migration}, num_tokens=0)

    async def wait_idle(self) -> None:
        async with asyncio.timeout(30):
            if self.live:
                await self.idle.wait()


class Client:
    """A proxy-side connection speaking the token protocol."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer
        self.buf = bytearray()

    @classmethod
    async def connect(cls, address: str) -> Client:
        host, _, port = address.rpartition(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        return cls(reader, writer)

    async def send(self, *msgs: Message) -> None:
        for msg in msgs:
            self.writer.write(frame(msg))
        await self.writer.drain()

    async def send_raw(self, data: bytes) -> None:
        self.writer.write(data)
        await self.writer.drain()

    async def recv(self, within_s: float = 30.0) -> Message:
        """The next frame; raises EOFError when the worker closed the connection."""
        return decode(await self.recv_raw(within_s), FRAMES)

    async def recv_raw(self, within_s: float = 30.0) -> bytes:
        """The next frame's body as sent (sealed after a handshake), one frame at a time."""
        async with asyncio.timeout(within_s):
            while True:
                if len(self.buf) >= 4:
                    size = int.from_bytes(self.buf[:4], "big")
                    if len(self.buf) >= 4 + size:
                        body = bytes(self.buf[4 : 4 + size])
                        del self.buf[: 4 + size]
                        return body
                data = await self.reader.read(65536)
                if not data:
                    raise EOFError("connection closed by the worker")
                self.buf += data

    async def close(self) -> None:
        self.writer.close()
        try:
            await self.writer.wait_closed()
        except ConnectionError:
            pass
