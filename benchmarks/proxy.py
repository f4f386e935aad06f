"""``star bench proxy``: tokens relayed per core and added latency per token.

A real proxy (``proxy.app`` behind ``proxy.http``, uvloop, own process)
with a fake backend; a client process holds N streaming ``/v1/completions``
open over loopback. Per concurrency level, a throughput phase (tokens
relayed per CPU second of the proxy) and a latency phase (engine hand-over
to chunk written); set-up is reported apart. Target, docs/design.md §7: <= 0.5 ms
p99 added per token at 1,000 streams, >= 50k tokens/s per core. What each
phase counts: docs/operations.md, "Relay speed". Loopback only, every loop
bounded; ``python -m benchmarks.proxy --help``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import heapq
import json
import multiprocessing as mp
import random
import sys
import time
from array import array
from collections.abc import AsyncIterator, Sequence
from dataclasses import asdict, dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, cast

from benchmarks.common import bench_main

DEFAULT_STREAMS = (1, 100, 1000)
_CORPUS = "the quick brown fox jumps over the lazy dog while a proxy relays tokens to clients"


@dataclass
class Row:
    """One concurrency level's results."""

    streams: int
    tokens: int  # relayed in the throughput phase
    relay_wall_s: float
    relay_cpu_s: float
    tokens_per_s: float  # wall clock, while all streams were open
    tokens_per_core_s: float  # tokens / CPU seconds of the proxy process
    setup_cpu_ms: float  # per request: accept, parse, tokenise, open the stream
    offered_tokens_per_s: float  # paced phase
    lat_tokens: int
    added_p50_ms: float
    added_p99_ms: float
    added_max_ms: float


# -- the proxy process ------------------------------------------------------------


class _BenchBackend:
    """Cycles the ids of a text to every stream of a phase.

    A phase starts producing once all of its streams have arrived (so the
    measured window has exactly N concurrent streams, and request set-up is
    accounted apart). Fast streams yield a one-token batch per event-loop turn.
    Paced streams are fed by one engine task, as a real upstream reader feeds
    them from worker frames: each tick it hands every stream whose token is
    due its next token, stamped with the time it did so. The stream resumes
    once the proxy has written that token's chunk to the socket: the
    difference is the latency the proxy added, including the wait behind the
    other streams served in the same tick.
    """

    def __init__(self, ids: list[int]) -> None:
        self.ids = ids
        self.phase(0, 0.0)

    def phase(self, streams: int, interval_s: float) -> None:
        """Reset for a phase of ``streams`` streams (``interval_s == 0``: fast)."""
        self.expect = streams
        self.interval_s = interval_s
        self.arrived = 0
        self.go = asyncio.Event()
        self.lat: array[float] = array("d")
        self.tokens = 0
        self.t_go = 0.0
        self.cpu_go = 0.0
        self._due: list[tuple[float, int, asyncio.Queue[float]]] = []

    def health(self) -> dict[str, Any]:
        return {"ok": True}

    async def engine(self) -> None:
        """Hand out due tokens every ~millisecond (runs until cancelled)."""
        clock = time.perf_counter
        while True:
            await asyncio.sleep(0.0005)
            now = clock()
            due = self._due
            while due and due[0][0] <= now:
                at, seq, queue = heapq.heappop(due)
                queue.put_nowait(clock())
                heapq.heappush(due, (at + self.interval_s, seq, queue))

    async def generate(self, req: Any) -> AsyncIterator[Any]:
        from proxy.backend import TokenBatch

        n, ids, interval = req.max_tokens, self.ids, self.interval_s
        clock = time.perf_counter
        self.arrived += 1
        seq = self.arrived
        if self.arrived == self.expect:
            self.t_go, self.cpu_go = clock(), time.process_time()
            self.go.set()
        await self.go.wait()
        queue: asyncio.Queue[float] | None = None
        if interval:
            queue = asyncio.Queue()
            heapq.heappush(self._due, (self.t_go + random.random() * interval, seq, queue))
        try:
            for i in range(n):
                if queue is None:
                    await asyncio.sleep(0)  # a real backend waits on a socket read
                    pushed = 0.0
                else:
                    pushed = await queue.get()
                self.tokens += 1
                yield TokenBatch([ids[i % len(ids)]], "length" if i == n - 1 else None)
                if pushed:
                    self.lat.append(clock() - pushed)
        finally:
            if queue is not None:
                self._due = [e for e in self._due if e[2] is not queue]
                heapq.heapify(self._due)


def _tokenizer_dir(model: str | None, scratch: Path) -> Path:
    if model:
        return Path(model)
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([_CORPUS] * 50, trainer)
    scratch.mkdir(parents=True, exist_ok=True)
    tok.save(str(scratch / "tokenizer.json"))
    return scratch


def _server_main(conn: Connection, model: str | None, scratch: str) -> None:
    import uvloop

    uvloop.run(_serve(conn, model, Path(scratch)))


async def _serve(conn: Connection, model: str | None, scratch: Path) -> None:
    import logging

    import structlog

    from proxy.app import ProxyApp, create_server
    from proxy.tokenizer import ModelCard
    from star.settings import ProxySettings

    # One log line per request would measure the terminal, not the proxy.
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    card = ModelCard.load(_tokenizer_dir(model, scratch), name="bench", max_model_len=10**9)
    ids = card.tokenizer.encode(_CORPUS, add_special_tokens=False).ids
    backend = _BenchBackend(ids)
    settings = ProxySettings(host="127.0.0.1", port=0, max_streams=100_000, drain_timeout_s=2.0)
    app = ProxyApp(backend, [card], settings)
    server = create_server(app, settings)
    await server.start()
    engine = asyncio.create_task(backend.engine())
    conn.send(server.port)
    loop = asyncio.get_running_loop()
    cpu0 = time.process_time()
    while True:
        cmd, arg = await loop.run_in_executor(None, conn.recv)
        if cmd == "phase":  # (streams, interval_s)
            backend.phase(*arg)
            cpu0 = time.process_time()
            conn.send(True)
        elif cmd == "stats":
            now = time.process_time()
            conn.send(
                {
                    "setup_cpu_s": backend.cpu_go - cpu0,
                    "relay_cpu_s": now - backend.cpu_go,
                    "relay_wall_s": time.perf_counter() - backend.t_go,
                    "tokens": backend.tokens,
                    "lat": backend.lat.tobytes(),
                }
            )
        else:
            break
    await server.shutdown(timeout_s=2.0)
    engine.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await engine


# -- the client (this process) ----------------------------------------------------


class _Stream(asyncio.Protocol):
    """Sends one streaming request and reads until ``[DONE]``, counting events."""

    def __init__(self, request: bytes, done: asyncio.Future[int]) -> None:
        self.request = request
        self.done = done
        self.events = 0
        self.tail = b""
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports do not subclass asyncio.Transport; same interface.
        self.transport = cast(asyncio.Transport, transport)
        self.transport.write(self.request)

    def data_received(self, data: bytes) -> None:
        if not self.events and not self.tail and not data.startswith(b"HTTP/1.1 200"):
            self.done.set_exception(RuntimeError(f"proxy answered {data[:300]!r}"))
            assert self.transport is not None
            self.transport.close()
            return
        buf = self.tail + data
        self.events += buf.count(b"data: ")
        self.tail = buf[-5:]
        if b"data: [DONE]" in buf and not self.done.done():
            self.done.set_result(self.events)
            assert self.transport is not None
            self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.done.done():
            self.done.set_exception(ConnectionError(f"stream closed early: {exc}"))


async def _phase(port: int, streams: int, tokens: int, timeout_s: float) -> float:
    body = json.dumps(
        {"model": "bench", "prompt": "go", "max_tokens": tokens, "stream": True}
    ).encode()
    request = (
        b"POST /v1/completions HTTP/1.1\r\nhost: bench\r\ncontent-type: application/json\r\n"
        b"content-length: " + str(len(body)).encode() + b"\r\n\r\n" + body
    )
    loop = asyncio.get_running_loop()
    futures: list[asyncio.Future[int]] = []
    t0 = time.perf_counter()
    async with asyncio.timeout(timeout_s):
        for _ in range(streams):
            fut: asyncio.Future[int] = loop.create_future()
            futures.append(fut)
            await loop.create_connection(
                functools.partial(_Stream, request, fut), "127.0.0.1", port
            )
        await asyncio.gather(*futures)
    return time.perf_counter() - t0


def _pct(values: Sequence[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def _measure(conn: Connection, port: int, streams: int, args: argparse.Namespace) -> Row:
    loop = asyncio.get_running_loop()

    async def ask(msg: tuple[str, Any]) -> Any:
        conn.send(msg)
        return await loop.run_in_executor(None, conn.recv)

    # Throughput: as fast as possible.
    per_stream = max(1, args.tokens // streams)
    await ask(("phase", (streams, 0.0)))
    await _phase(port, streams, per_stream, args.timeout)
    fast = await ask(("stats", None))
    # Latency: paced.
    interval = args.interval_ms / 1000
    await ask(("phase", (streams, interval)))
    await _phase(port, streams, max(2, int(args.seconds / interval)), args.timeout)
    paced = await ask(("stats", None))
    lat = array("d")
    lat.frombytes(paced["lat"])
    ms = [v * 1000 for v in lat]
    cpu, wall, relayed = fast["relay_cpu_s"], fast["relay_wall_s"], fast["tokens"]
    return Row(
        streams=streams,
        tokens=relayed,
        relay_wall_s=round(wall, 3),
        relay_cpu_s=round(cpu, 3),
        tokens_per_s=round(relayed / wall),
        tokens_per_core_s=round(relayed / cpu) if cpu > 0 else 0,
        setup_cpu_ms=round(fast["setup_cpu_s"] / streams * 1000, 3),
        offered_tokens_per_s=round(streams / interval),
        lat_tokens=len(ms),
        added_p50_ms=round(_pct(ms, 0.50), 3),
        added_p99_ms=round(_pct(ms, 0.99), 3),
        added_max_ms=round(max(ms, default=float("nan")), 3),
    )


async def _client(conn: Connection, levels: list[int], args: argparse.Namespace) -> list[Row]:
    port = conn.recv()
    rows = []
    for streams in levels:
        rows.append(await _measure(conn, port, streams, args))
        if not args.json:
            _print_row(rows[-1], header=len(rows) == 1)
    return rows


_COLUMNS = (
    ("streams", "streams", 7),
    ("tokens", "tokens", 7),
    ("tokens_per_s", "tok/s", 7),
    ("tokens_per_core_s", "tok/s/core", 10),
    ("setup_cpu_ms", "setup ms/req", 12),
    ("offered_tokens_per_s", "paced tok/s", 11),
    ("added_p50_ms", "p50 ms", 7),
    ("added_p99_ms", "p99 ms", 7),
    ("added_max_ms", "max ms", 7),
)


def print_columns(columns: Sequence[tuple[str, str, int]], item: Any, header: bool) -> None:
    """One dataclass as a line of right-aligned columns (key, title, width), the titles first."""
    if header:
        print("  ".join(title.rjust(w) for _, title, w in columns))
    values = asdict(item)
    print("  ".join(str(values[key]).rjust(w) for key, _, w in columns), flush=True)


def _print_row(row: Row, header: bool) -> None:
    print_columns(_COLUMNS, row, header)


def configure(parser: argparse.ArgumentParser) -> None:
    """Add this benchmark's flags to ``parser`` (``star bench proxy`` and ``-m``)."""
    parser.add_argument(
        "--streams",
        default=",".join(map(str, DEFAULT_STREAMS)),
        help="comma-separated concurrency levels (default %(default)s)",
    )
    parser.add_argument(
        "--tokens", type=int, default=100_000, help="tokens per level, throughput phase"
    )
    parser.add_argument(
        "--interval-ms", type=float, default=40.0, help="per-stream token interval when paced"
    )
    parser.add_argument(
        "--seconds", type=float, default=3.0, help="length of the paced (latency) phase"
    )
    parser.add_argument(
        "--model", default=None, help="model dir with tokenizer.json (default: built)"
    )
    parser.add_argument(
        "--timeout", type=float, default=120.0, help="give up on a phase after this"
    )
    parser.add_argument("--json", action="store_true", help="print rows as JSON")


def run(args: argparse.Namespace) -> int:
    """Run the benchmark described by ``args``; print a table or ``--json``."""
    try:
        levels = [int(s) for s in str(args.streams).split(",") if s.strip()]
        if not levels or min(levels) < 1 or max(levels) > 10_000:
            raise ValueError
    except ValueError:
        print(
            f"bench proxy: --streams {args.streams!r}: expected integers 1..10000", file=sys.stderr
        )
        return 2
    import tempfile

    import uvloop

    ctx = mp.get_context("spawn")
    ours, theirs = ctx.Pipe()
    with tempfile.TemporaryDirectory(prefix="star-bench-proxy-") as scratch:
        proc = ctx.Process(target=_server_main, args=(theirs, args.model, scratch), daemon=True)
        proc.start()
        try:
            rows = uvloop.run(_client(ours, levels, args))
        finally:
            with contextlib.suppress(OSError):
                ours.send(("stop", None))
            proc.join(timeout=10)
            if proc.is_alive():
                proc.terminate()
                proc.join(timeout=5)
    if args.json:
        print(json.dumps([asdict(r) for r in rows], indent=2))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m benchmarks.proxy``."""
    return bench_main("benchmarks.proxy", configure, run, __doc__, argv)


if __name__ == "__main__":
    sys.exit(main())
