"""A small Service run as a real process by test_process.py."""

from __future__ import annotations

import asyncio
import sys

from star.logs import configure_logging
from star.process import Service
from star.settings import LogSettings


class Sleepy(Service):
    name = "sleepy"

    def __init__(self, drain_s: float, drain_timeout_s: float) -> None:
        super().__init__(drain_timeout_s)
        self.drain_s = drain_s

    async def startup(self) -> None:
        print("startup", flush=True)

    async def drain(self) -> None:
        print("drain-begin", flush=True)
        await asyncio.sleep(self.drain_s)
        print("drain-end", flush=True)

    async def cleanup(self) -> None:
        print("cleanup", flush=True)


if __name__ == "__main__":
    configure_logging(LogSettings(format="json"))
    sys.exit(Sleepy(float(sys.argv[1]), float(sys.argv[2])).run())
