"""A host's link through user space, where delay and loss are set (netem without netem).

This kernel has no ``sch_netem``. A shaped host (:meth:`Network.shaped
<benchmarks.chaos.netns.Network>`) gets a pair of TAP devices instead of a
veth pair: one inside its namespace (``eth0``), one on the bridge, and this
process copies Ethernet frames between them, each direction on its own:
a frame is dropped with probability ``loss`` or written ``delay`` seconds
after it was read (order kept: a constant delay). It reads its settings as
JSON lines on stdin (``{"delay_ms": 50, "loss_pct": 5}``) and answers each
with ``ok``; EOF on stdin ends it.

Run by :class:`benchmarks.chaos.netns.Network`:
``python -m benchmarks.chaos.wire INNER_TAP OUTER_TAP`` in the root
namespace, before ``INNER_TAP`` moves into the host's namespace (an open
TAP descriptor follows its device).
"""

from __future__ import annotations

import asyncio
import fcntl
import json
import os
import random
import struct
import sys

TUNSETIFF = 0x400454CA
IFF_TAP = 0x0002
IFF_NO_PI = 0x1000


def open_tap(name: str) -> int:
    """A non-blocking descriptor on the existing TAP device ``name``."""
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
    fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", name.encode(), IFF_TAP | IFF_NO_PI))
    return fd


class Link:
    """Both directions between two TAP descriptors, shaped alike."""

    def __init__(self, a: int, b: int) -> None:
        self.a, self.b = a, b
        self.delay_s = 0.0
        self.loss = 0.0
        self.rng = random.Random(0)

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        loop.add_reader(self.a, self._copy, loop, self.a, self.b)
        loop.add_reader(self.b, self._copy, loop, self.b, self.a)

    def _copy(self, loop: asyncio.AbstractEventLoop, src: int, dst: int) -> None:
        for _ in range(64):  # a burst per wake-up
            try:
                frame = os.read(src, 65536)
            except BlockingIOError:
                return
            except OSError:
                return
            if self.loss and self.rng.random() < self.loss:
                continue
            if self.delay_s:
                loop.call_later(self.delay_s, _write, dst, frame)
            else:
                _write(dst, frame)


def _write(fd: int, frame: bytes) -> None:
    try:
        os.write(fd, frame)
    except OSError:
        pass  # a full queue drops, as a wire would


async def main(inner: str, outer: str) -> None:
    loop = asyncio.get_running_loop()
    link = Link(open_tap(inner), open_tap(outer))
    link.start(loop)
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    print("ok", flush=True)
    while line := await reader.readline():
        doc = json.loads(line)
        link.delay_s = float(doc.get("delay_ms", 0.0)) / 1000
        link.loss = float(doc.get("loss_pct", 0.0)) / 100
        print("ok", flush=True)


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2]))
