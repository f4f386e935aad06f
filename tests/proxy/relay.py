"""A user-space TCP relay that can go silent: a partition without a RST.

Each accepted connection is relayed to ``target`` by two pumps. :meth:`Relay.cut`
makes every pump stop forwarding without closing anything, the way a silent
partition looks to both ends: ``"drop"`` reads and discards (packets lost, no
back-pressure), ``"stall"`` stops reading (the senders' buffers fill).
New connections are still accepted meanwhile, and relayed the same way.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import Counter
from typing import Literal

Mode = Literal["forward", "drop", "stall"]


class Relay:
    def __init__(self, target: str) -> None:
        self.target = target
        self.mode: Mode = "forward"
        self.forwarded: Counter[str] = Counter()  # bytes by direction: "up" (to target), "down"
        self.accepted = 0
        self._healed = asyncio.Event()
        self._healed.set()
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._writers: list[asyncio.StreamWriter] = []
        self.address = ""

    async def start(self) -> Relay:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        self.address = f"127.0.0.1:{self._server.sockets[0].getsockname()[1]}"
        return self

    def cut(self, mode: Mode = "drop") -> None:
        """Stop forwarding in both directions; nothing is closed."""
        self.mode = mode
        self._healed.clear()

    def heal(self) -> None:
        self.mode = "forward"
        self._healed.set()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.accepted += 1
        host, _, port = self.target.rpartition(":")
        up_reader, up_writer = await asyncio.open_connection(host, int(port))
        self._writers += [writer, up_writer]
        for src, dst, direction in ((reader, up_writer, "up"), (up_reader, writer, "down")):
            task = asyncio.create_task(self._pump(src, dst, direction))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _pump(
        self, src: asyncio.StreamReader, dst: asyncio.StreamWriter, direction: str
    ) -> None:
        with contextlib.suppress(ConnectionError, OSError):
            while True:
                if self.mode == "stall":
                    await self._healed.wait()
                data = await src.read(65536)
                if not data:
                    break
                if self.mode == "drop":
                    continue
                if self.mode == "stall":  # read before the cut: held until the heal
                    await self._healed.wait()
                dst.write(data)
                await dst.drain()
                self.forwarded[direction] += len(data)
            if self.mode == "forward":
                dst.close()  # a close crosses a working relay; a cut one loses it too

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for writer in self._writers:
            writer.transport.abort()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()
