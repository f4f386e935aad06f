"""``star bench proxy``: tokens relayed per core and added latency per token.

A real proxy (``proxy.app`` behind ``proxy.http``, uvloop, own process)
with a fake backend; a client process holds N streaming ``/v1/completions``
open over loopback. Per concurrency level, a throughput phase (tokens
relayed per CPU second of the proxy) and a latency phase (engine hand-over
to chunk written); set-up is reported apart. Target, docs/design.md §7: <= 0.5 ms
p99 added per token at 1,000 streams, >= 50k tokens/s per core. What each
phase counts: docs/operations.md, "Relay speed". Loopback only, every loop
bounded; ``python -m benchmarks.proxy --help``.

``--seal on,off`` measures the relay through the token protocol instead:
the tokens come from a worker process (a real ``workers.server.TokenServer``
with an engine that yields a token per event-loop turn) over one
multiplexed connection, read by the proxy's real upstream
(``proxy.upstream.WorkerPool``, ``proxy.decode_run.DecodeRun``). "on" is a
connection with ``cluster.secret`` set (handshake, every frame sealed with
AES-256-GCM), "off" one without (loopback only, as production allows), both
served by the same worker process side by side; the throughput phase runs
``--repeats`` times per level, the two settings interleaved (on, off, off,
on, ...), and each repeat's on / off ratio of tokens per proxy CPU second is
reported with its spread (issue 27: the sealed channel's cost per frame).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import functools
import heapq
import json
import multiprocessing as mp
import random
import secrets
import statistics
import sys
import time
from array import array
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
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


SEAL_MODES = ("on", "off")
_RELAY_INSTANCE = "decode-bench"


class _RelayBackend(_BenchBackend):
    """The throughput phase through the token protocol (``--seal``).

    Every stream is a real :class:`proxy.decode_run.DecodeRun` on a
    connection of :class:`proxy.upstream.WorkerPool` to the worker process:
    the pool with ``cluster.secret`` for "on" (sealed frames), the one without
    for "off". The phase's setting picks the pool; connections are opened
    (handshake included) before a phase starts, so its window holds only the
    relay. This object is the runs' fleet (no bus, no recovery elsewhere).
    """

    origin = "bench"
    handing_off = False

    def __init__(self, ids: list[int], workers: dict[str, str], secret: str) -> None:
        from proxy.upstream import WorkerPool

        self.workers = workers
        self.pools = {"on": WorkerPool(secret=secret), "off": WorkerPool()}
        self.mode = "on"
        super().__init__(ids)

    def phase(self, streams: int, interval_s: float, mode: str = "on") -> None:
        if interval_s:
            raise ValueError("the relay backend has the throughput phase only")
        super().phase(streams, interval_s)
        self.mode = mode

    async def connect(self) -> None:
        """Open (or check) this phase's connection before the window starts."""
        await self.pools[self.mode].get(self.workers[self.mode])

    async def close(self) -> None:
        for pool in self.pools.values():
            for address in self.workers.values():
                client = pool._clients.get(address)
                if client is not None:
                    await client.close()

    # -- proxy.decode_run.Fleet --
    async def open_leg(self, address: str) -> Any:
        client = await self.pools[self.mode].get(address)
        return client.open()

    def decode_members(self) -> list[tuple[str, str]]:
        return [(_RELAY_INSTANCE, self.workers[self.mode])]

    def mark_down(self, address: str) -> None:
        pass

    def emit_event(self, event: Any) -> None:
        pass

    async def rejoin(self, instance: str, address: str, request_id: str) -> None:
        return None  # the bench's requests are not resumable

    async def generate(self, req: Any) -> AsyncIterator[Any]:
        from proxy.decode_run import DecodeRun

        self.arrived += 1
        if self.arrived == self.expect:
            self.t_go, self.cpu_go = time.perf_counter(), time.process_time()
            self.go.set()
        await self.go.wait()
        # The worker's engine cycles the prompt's ids: the corpus, which the
        # card detokenises as the fake backend's text.
        req = dataclasses.replace(req, prompt_token_ids=self.ids)
        run = DecodeRun(self, req, dict(req.sampling), "bench: not migrated")
        await run.start(_RELAY_INSTANCE, self.workers[self.mode], None)
        async for batch in run.run():
            self.tokens += len(batch.token_ids)
            yield batch


class _RelayEngine:
    """The worker's engine: ``max_tokens`` tokens cycling the prompt's ids, each stream one
    token per ``interval_s`` from a random phase (0: one per event-loop turn, as fast as
    the worker runs)."""

    interval_s = 0.0

    async def generate(self, request: Any) -> AsyncGenerator[Any, None]:
        from workers.protocol import TokenDelta

        ids, n, interval = (
            request.prompt_token_ids,
            int(request.sampling["max_tokens"]),
            self.interval_s,
        )
        clock = time.perf_counter
        due = clock() + random.random() * interval
        for i in range(n):
            if interval:
                await asyncio.sleep(max(0.0, due - clock()))
                due += interval
            else:
                await asyncio.sleep(0)  # a real engine's outputs come between loop turns
            yield TokenDelta([ids[i % len(ids)]], "length" if i == n - 1 else None)

    async def release(self, request_id: str, migration: str) -> Any:
        from workers.protocol import Unsupported

        raise Unsupported("no D->D release in the relay benchmark")


def _worker_main(conn: Connection, secret: str) -> None:
    import uvloop

    uvloop.run(_work(conn, secret))


async def _work(conn: Connection, secret: str) -> None:
    """One worker process, two token servers on one engine: with the secret ("on"), without."""
    import logging

    import structlog

    from star.wire import Hello
    from workers.server import TokenServer

    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    engine = _RelayEngine()
    hello = Hello(instance=_RELAY_INSTANCE, role="decode", model="bench")
    servers = {
        "on": TokenServer(engine, hello, "127.0.0.1", 0, secret=secret),
        "off": TokenServer(engine, hello, "127.0.0.1", 0),
    }
    for server in servers.values():
        await server.start()
    conn.send({mode: server.address for mode, server in servers.items()})
    loop = asyncio.get_running_loop()
    while True:
        cmd, arg = await loop.run_in_executor(None, conn.recv)
        if cmd == "cpu":
            conn.send(time.process_time())
        elif cmd == "pace":  # seconds between a stream's tokens (0: unpaced)
            engine.interval_s = arg
            conn.send(True)
        else:
            break
    for server in servers.values():
        await server.shutdown(drain_timeout=1.0)


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


def _server_main(
    conn: Connection,
    model: str | None,
    scratch: str,
    workers: dict[str, str] | None = None,
    secret: str = "",
) -> None:
    import uvloop

    uvloop.run(_serve(conn, model, Path(scratch), workers, secret))


async def _serve(
    conn: Connection,
    model: str | None,
    scratch: Path,
    workers: dict[str, str] | None = None,
    secret: str = "",
) -> None:
    import logging

    import structlog

    from proxy.app import ProxyApp, create_server
    from proxy.tokenizer import ModelCard
    from star.settings import ProxySettings

    # One log line per request would measure the terminal, not the proxy.
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    card = ModelCard.load(_tokenizer_dir(model, scratch), name="bench", max_model_len=10**9)
    ids = card.tokenizer.encode(_CORPUS, add_special_tokens=False).ids
    backend = _BenchBackend(ids) if workers is None else _RelayBackend(ids, workers, secret)
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
        if cmd == "phase":  # (streams, interval_s[, seal mode])
            backend.phase(*arg)
            if isinstance(backend, _RelayBackend):
                await backend.connect()
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
    if isinstance(backend, _RelayBackend):
        await backend.close()
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


@dataclass
class SealRow:
    """One concurrency level, relayed through the token protocol, sealed and not (``--seal``)."""

    streams: int
    repeats: int
    tokens: int  # relayed per phase
    offered_tokens_per_s: float  # all streams together (0: as fast as the worker sends)
    missing_tokens: int  # over every phase: streams cut short (0 in a valid run)
    proxy_us_per_token: dict[str, float]  # CPU of the proxy process, median over the repeats
    tokens_per_core_s: dict[str, list[int]]  # every repeat, per setting
    tokens_per_s: dict[str, float]  # wall clock, median
    worker_us_per_token: dict[str, float]  # CPU of the worker process, median
    ratio_on_off: float  # tokens per proxy CPU s, sealed / not, median of the repeats' ratios
    ratio_min: float
    ratio_max: float
    ratio_p25: float  # the middle half of the repeats' ratios
    ratio_p75: float
    seal_us_per_token: float  # proxy µs per token, on minus off (medians)


async def _measure_seal(
    conn: Connection, worker: Connection, port: int, streams: int, args: argparse.Namespace
) -> SealRow:
    loop = asyncio.get_running_loop()

    async def ask(c: Connection, msg: Any) -> Any:
        c.send(msg)
        return await loop.run_in_executor(None, c.recv)

    modes = list(args.seal)
    per_stream = max(1, args.tokens // streams)
    await ask(worker, ("pace", streams / args.relay_rate if args.relay_rate > 0 else 0.0))
    core: dict[str, list[float]] = {m: [] for m in modes}
    wall: dict[str, list[float]] = {m: [] for m in modes}
    worker_us: dict[str, list[float]] = {m: [] for m in modes}
    ratios: list[float] = []
    missing = 0
    for r in range(args.repeats):
        # Interleaved, the order alternating (on, off, off, on, ...): drift in
        # the machine's load falls on both settings alike.
        this: dict[str, float] = {}
        for mode in modes if r % 2 == 0 else modes[::-1]:
            await ask(conn, ("phase", (streams, 0.0, mode)))
            w0 = await ask(worker, ("cpu", None))
            await _phase(port, streams, per_stream, args.timeout)
            w1 = await ask(worker, ("cpu", None))
            st = await ask(conn, ("stats", None))
            tokens, cpu = st["tokens"], st["relay_cpu_s"]
            missing += streams * per_stream - tokens
            this[mode] = tokens / cpu if cpu > 0 else float("nan")
            core[mode].append(this[mode])
            wall[mode].append(tokens / st["relay_wall_s"])
            worker_us[mode].append((w1 - w0) / max(1, tokens) * 1e6)
        if "on" in this and "off" in this:
            ratios.append(this["on"] / this["off"])
    med = statistics.median
    us = {m: round(1e6 / med(core[m]), 3) for m in modes}
    return SealRow(
        streams=streams,
        repeats=args.repeats,
        tokens=streams * per_stream,
        offered_tokens_per_s=float(args.relay_rate),
        missing_tokens=missing,
        proxy_us_per_token=us,
        tokens_per_core_s={m: [round(v) for v in core[m]] for m in modes},
        tokens_per_s={m: round(med(wall[m])) for m in modes},
        worker_us_per_token={m: round(med(worker_us[m]), 3) for m in modes},
        ratio_on_off=round(med(ratios), 4) if ratios else float("nan"),
        ratio_min=round(min(ratios), 4) if ratios else float("nan"),
        ratio_max=round(max(ratios), 4) if ratios else float("nan"),
        ratio_p25=round(_pct(ratios, 0.25), 4),
        ratio_p75=round(_pct(ratios, 0.75), 4),
        seal_us_per_token=round(us["on"] - us["off"], 3) if len(us) == 2 else float("nan"),
    )


def _print_seal_row(row: SealRow, header: bool) -> None:
    if header:
        print(
            "streams  setting  proxy tok/s/core (median; each repeat)"
            "  proxy µs/token  worker µs/token  tok/s"
        )
    for mode, values in row.tokens_per_core_s.items():
        each = ", ".join(map(str, values))
        print(
            f"{row.streams:>7}  {mode:>7}  {round(statistics.median(values)):>8} ({each})"
            f"  {row.proxy_us_per_token[mode]:>8.3f}  {row.worker_us_per_token[mode]:>8.3f}"
            f"  {row.tokens_per_s[mode]:>8}",
            flush=True,
        )
    if row.ratio_on_off == row.ratio_on_off:  # not nan
        print(
            f"{row.streams:>7}  on / off: {row.ratio_on_off:.3f} of the tokens per proxy CPU "
            f"second (middle half of the repeats {row.ratio_p25:.3f}–{row.ratio_p75:.3f}, all "
            f"{row.ratio_min:.3f}–{row.ratio_max:.3f}); sealing "
            f"{row.seal_us_per_token:+.3f} µs per token at the proxy",
            flush=True,
        )
    if row.missing_tokens:
        print(
            f"{row.streams:>7}  INVALID: {row.missing_tokens} tokens missing (streams cut short; "
            "the proxy's log says why)",
            flush=True,
        )


async def _client_seal(
    conn: Connection, worker: Connection, levels: list[int], args: argparse.Namespace
) -> list[SealRow]:
    port = conn.recv()
    rows = []
    for streams in levels:
        rows.append(await _measure_seal(conn, worker, port, streams, args))
        if not args.json:
            _print_seal_row(rows[-1], header=len(rows) == 1)
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
    parser.add_argument(
        "--seal",
        default="",
        help="relay through the token protocol from a worker process, with cluster.secret "
        "(on: frames sealed) and/or without (off), e.g. on,off: the throughput phase only, "
        "the settings interleaved (default: the in-process fake backend)",
    )
    parser.add_argument(
        "--repeats", type=int, default=5, help="with --seal: throughput phases per setting"
    )
    parser.add_argument(
        "--relay-rate",
        type=float,
        default=5000.0,
        help="with --seal: tokens/s the worker offers, all streams together, each stream "
        "paced (0: as fast as the worker sends, which can outrun the proxy)",
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
    seal = [m.strip() for m in str(args.seal).split(",") if m.strip()]
    if len(set(seal)) != len(seal) or not set(seal) <= set(SEAL_MODES) or args.repeats < 1:
        print(
            f"bench proxy: --seal {args.seal!r} --repeats {args.repeats}: expected on, off or "
            "on,off and at least one repeat",
            file=sys.stderr,
        )
        return 2
    args.seal = seal
    import tempfile

    import uvloop

    ctx = mp.get_context("spawn")
    ours, theirs = ctx.Pipe()
    rows: Sequence[Row | SealRow]
    with contextlib.ExitStack() as stack:
        scratch = stack.enter_context(tempfile.TemporaryDirectory(prefix="star-bench-proxy-"))
        workers: dict[str, str] | None = None
        worker_conn: Connection | None = None
        secret = secrets.token_hex(32)
        if seal:
            worker_conn, worker_end = ctx.Pipe()
            wproc = ctx.Process(target=_worker_main, args=(worker_end, secret), daemon=True)
            wproc.start()
            stack.callback(_stop, wproc, worker_conn, ("stop", None))
            workers = worker_conn.recv()
        proc = ctx.Process(
            target=_server_main, args=(theirs, args.model, scratch, workers, secret), daemon=True
        )
        proc.start()
        stack.callback(_stop, proc, ours, ("stop", None))
        if worker_conn is not None:
            rows = uvloop.run(_client_seal(ours, worker_conn, levels, args))
        else:
            rows = uvloop.run(_client(ours, levels, args))
    if args.json:
        print(json.dumps([asdict(r) for r in rows], indent=2))
    return 0


def _stop(proc: mp.process.BaseProcess, conn: Connection, msg: Any) -> None:
    """Ask a child process to stop (``msg`` on its pipe), then make sure it has."""
    with contextlib.suppress(OSError):
        conn.send(msg)
    proc.join(timeout=10)
    if proc.is_alive():
        proc.terminate()
        proc.join(timeout=5)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m benchmarks.proxy``."""
    return bench_main("benchmarks.proxy", configure, run, __doc__, argv)


if __name__ == "__main__":
    sys.exit(main())
