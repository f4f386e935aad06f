"""A minimal raw-socket HTTP/1.1 client, to send what well-behaved clients never would."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass
class RawResponse:
    status: int
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


def request_bytes(
    method: str,
    path: str,
    body: bytes | dict[str, Any] | None = None,
    headers: dict[str, str] | None = None,
) -> bytes:
    if isinstance(body, dict):
        body = json.dumps(body).encode()
    lines = [f"{method} {path} HTTP/1.1", "host: test"]
    for k, v in (headers or {}).items():
        lines.append(f"{k}: {v}")
    if body is not None:
        lines.append("content-type: application/json")
        lines.append(f"content-length: {len(body)}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + (body or b"")


async def exchange(port: int, data: bytes, wait_s: float = 30.0) -> bytes:
    """Send ``data``, read until the server closes (or ``wait_s`` passes)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(data)
        await writer.drain()
        out = b""
        with contextlib.suppress(TimeoutError, ConnectionResetError):
            async with asyncio.timeout(wait_s):
                while chunk := await reader.read(65536):
                    out += chunk
        return out
    finally:
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()


async def until(predicate: Callable[[], bool], wait_s: float = 30.0) -> None:
    """Poll ``predicate`` (state owned by the code under test has no event to wait on)."""
    async with asyncio.timeout(wait_s):
        while not predicate():  # noqa: ASYNC110
            await asyncio.sleep(0.005)


def parse_responses(data: bytes) -> list[RawResponse]:
    """Split a byte stream into responses (Content-Length, chunked or close-delimited)."""
    out = []
    while data:
        head, sep, rest = data.partition(b"\r\n\r\n")
        assert sep, f"incomplete head: {data[:200]!r}"
        lines = head.decode("latin-1").split("\r\n")
        status = int(lines[0].split()[1])
        headers = {}
        for line in lines[1:]:
            k, _, v = line.partition(":")
            headers[k.strip().lower()] = v.strip()
        if "content-length" in headers:
            n = int(headers["content-length"])
            body, data = rest[:n], rest[n:]
        elif headers.get("transfer-encoding") == "chunked":
            body, data = _dechunk(rest)
        else:
            body, data = rest, b""
        out.append(RawResponse(status, headers, body))
    return out


def _dechunk(data: bytes) -> tuple[bytes, bytes]:
    parts, pos = [], 0
    while True:
        eol = data.index(b"\r\n", pos)
        size = int(data[pos:eol].split(b";")[0], 16)
        pos = eol + 2
        if size == 0:
            pos = data.index(b"\r\n", pos) + 2  # no trailers in our tests
            return b"".join(parts), data[pos:]
        parts.append(data[pos : pos + size])
        pos += size + 2
