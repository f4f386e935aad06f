"""Server-sent events framing, sans-IO (the WHATWG ``text/event-stream`` format).

OpenAI streams are ``data: <json>\\n\\n`` events ended by ``data: [DONE]\\n\\n``.
The encoder side is three byte-string helpers; :class:`SSEDecoder` is the
receiving side, used by the tests and the benchmark client (and by anything
that needs to read an OpenAI-style stream without a client library).
"""

from __future__ import annotations

from dataclasses import dataclass

CONTENT_TYPE = "text/event-stream; charset=utf-8"
DONE = b"data: [DONE]\n\n"
DONE_DATA = "[DONE]"


def event(data: bytes) -> bytes:
    """Frame one single-line payload (compact JSON never contains a newline)."""
    return b"data: " + data + b"\n\n"


def comment(text: str = "") -> bytes:
    """A comment line; clients ignore it, proxies see traffic (keep-alive pings)."""
    return b": " + text.encode() + b"\n\n"


@dataclass(slots=True)
class Event:
    """One decoded event: its ``data`` lines joined by newlines, and its type."""

    data: str
    event: str = "message"
    id: str | None = None


class SSEDecoder:
    """Incremental SSE parser: feed bytes as they arrive, get whole events back.

    Lines may end in LF, CR LF or CR; a line split across two ``feed`` calls,
    or a UTF-8 character split across them, is handled by buffering the
    incomplete last line.
    """

    def __init__(self) -> None:
        self._buf = b""
        self._data: list[str] = []
        self._event = ""
        self._id: str | None = None

    def feed(self, chunk: bytes) -> list[Event]:
        """Consume ``chunk``; return the events it completed, in order."""
        self._buf += chunk
        out: list[Event] = []
        while True:
            cut = _line_end(self._buf)
            if cut is None:
                return out
            end, nxt = cut
            line = self._buf[:end].decode("utf-8", errors="replace")
            self._buf = self._buf[nxt:]
            ev = self._line(line)
            if ev is not None:
                out.append(ev)

    def _line(self, line: str) -> Event | None:
        if not line:
            if not self._data and not self._event:
                return None
            ev = Event("\n".join(self._data), self._event or "message", self._id)
            self._data, self._event = [], ""
            return ev
        if line.startswith(":"):
            return None
        name, _, value = line.partition(":")
        if value.startswith(" "):
            value = value[1:]
        if name == "data":
            self._data.append(value)
        elif name == "event":
            self._event = value
        elif name == "id":
            self._id = value
        return None


def _line_end(buf: bytes) -> tuple[int, int] | None:
    """(end of the first line, start of the next) or None if no line is complete."""
    lf = buf.find(b"\n")
    cr = buf.find(b"\r")
    if cr == -1 or (lf != -1 and lf < cr):
        return None if lf == -1 else (lf, lf + 1)
    # A lone CR at the very end may be the first half of CR LF: wait for more.
    if cr == len(buf) - 1:
        return None
    return (cr, cr + 2) if buf[cr + 1 : cr + 2] == b"\n" else (cr, cr + 1)
