"""``star bench proxy-hold``: N streams held open through one proxy for minutes.

Issue #17, "load held": 1,000 concurrent SSE streams through one proxy for
>= 5 minutes, p50/p99 added latency per token, proxy memory flat, 0 errors;
a client that stops reading must not stall the others nor grow memory.
The proxy and the added-latency measure are ``star bench proxy``'s; slots
reopen their streams at once, ``--stalled`` clients never read. Per
``--window-s``: latency, tokens, streams, errors, RSS, buffered bytes, cuts;
a table or ``--json``; ``--quick`` is a smoke test. Details and a measured
run: docs/operations.md, "Held load". Loopback only, every wait bounded.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import heapq
import json
import logging
import math
import multiprocessing as mp
import random
import socket
import sys
import time
from array import array
from collections import Counter
from collections.abc import AsyncIterator, Mapping, MutableMapping, Sequence
from dataclasses import asdict, dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from benchmarks.common import bench_main
from benchmarks.proxy import _CORPUS, _Stream, _tokenizer_dir, print_columns

_STALL_PROMPT = "stall"
_STALL_BATCH = 1024  # tokens per batch to a stalled client: its socket buffers fill in a few turns
_RCVBUF = 4096  # a stalled client's receive buffer: the proxy's flow control shows sooner
# Added latency goes into a fixed histogram (buckets 1 % wide from 1 µs), not a
# list: the proxy's RSS is then the proxy's, not the instrument's.
_H_BASE, _H_STEP = 1e-6, math.log(1.01)
_H_BUCKETS = int(math.log(1000 / _H_BASE) / _H_STEP) + 1  # up to 1,000 s


@dataclass
class Window:
    """One ``--window-s`` of the hold."""

    end_s: float  # since the hold began
    tokens: int  # paced tokens relayed in the window
    streams_done: int  # streams read to [DONE]
    errors: int
    added_p50_ms: float
    added_p99_ms: float
    added_max_ms: float
    rss_mib: float  # at the window's end
    rss_max_mib: float
    buffered_kib: float  # bytes the proxy's transports hold, at the window's end
    open_streams: int  # requests in flight in the proxy, at the window's end
    stalled_cut: int  # non-reading clients the proxy cut in the window


# -- the proxy process ------------------------------------------------------------


class _HoldBackend:
    """Paced streams fed by one engine task; stalled-client streams as fast as taken."""

    def __init__(self, ids: list[int], stall_ids: list[int], interval_s: float) -> None:
        self.ids = ids
        self.stall_ids = stall_ids
        self.interval_s = interval_s
        self.hist = array("q", bytes(8 * _H_BUCKETS))
        self.max_s = 0.0
        self.tokens = 0
        self._due: list[tuple[float, int, int]] = []
        self._live: dict[int, asyncio.Queue[float]] = {}
        self._seq = 0

    def health(self) -> dict[str, Any]:
        return {"ok": True}

    def take(self) -> tuple[bytes, float, int]:
        """The latency histogram, the largest latency and the token count since the last call."""
        out = self.hist.tobytes(), self.max_s, self.tokens
        self.hist[:] = array("q", bytes(8 * _H_BUCKETS))
        self.max_s, self.tokens = 0.0, 0
        return out

    async def engine(self) -> None:
        """Hand out due tokens every ~millisecond (runs until cancelled)."""
        clock = time.perf_counter
        due, live = self._due, self._live
        while True:
            await asyncio.sleep(0.0005)
            now = clock()
            while due and due[0][0] <= now:
                at, seq, _ = heapq.heappop(due)
                queue = live.get(seq)
                if queue is not None:  # else the stream has ended
                    queue.put_nowait(clock())
                    heapq.heappush(due, (at + self.interval_s, seq, 0))

    async def generate(self, req: Any) -> AsyncIterator[Any]:
        from proxy.backend import TokenBatch

        n, ids = req.max_tokens, self.ids
        if req.prompt_token_ids == self.stall_ids:
            batch = (ids * (_STALL_BATCH // len(ids) + 1))[:_STALL_BATCH]
            for _ in range(n // _STALL_BATCH):
                await asyncio.sleep(0)  # a real backend waits on a socket read
                yield TokenBatch(batch)
            return
        clock, log, hist, last = time.perf_counter, math.log, self.hist, _H_BUCKETS - 1
        self._seq += 1
        seq, queue = self._seq, asyncio.Queue[float]()
        self._live[seq] = queue
        heapq.heappush(self._due, (clock() + random.random() * self.interval_s, seq, 0))
        try:
            for i in range(n):
                pushed = await queue.get()
                self.tokens += 1
                yield TokenBatch([ids[i % len(ids)]], "length" if i == n - 1 else None)
                added = clock() - pushed
                hist[min(last, int(log(max(added, _H_BASE) / _H_BASE) / _H_STEP))] += 1
                if added > self.max_s:
                    self.max_s = added
        finally:
            del self._live[seq]


def _server_main(conn: Connection, scratch: str, interval_s: float, stall_s: float) -> None:
    import uvloop

    uvloop.run(_serve(conn, Path(scratch), interval_s, stall_s))


async def _serve(conn: Connection, scratch: Path, interval_s: float, stall_s: float) -> None:
    import structlog

    from proxy.app import ProxyApp, create_server
    from proxy.tokenizer import ModelCard
    from star.settings import ProxySettings

    warnings: Counter[str] = Counter()
    cut_clients: list[str] = []

    def count(_: Any, __: str, event: MutableMapping[str, Any]) -> Mapping[str, Any]:
        warnings[event["event"]] += 1
        if event["event"] == "http_stream_write_stalled":
            cut_clients.append(event["client"])
        raise structlog.DropEvent

    # Warnings are counted, not printed; one line per request would measure the terminal.
    structlog.configure(
        processors=[count], wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING)
    )
    card = ModelCard.load(_tokenizer_dir(None, scratch), name="bench", max_model_len=10**9)
    encode = card.tokenizer.encode
    backend = _HoldBackend(
        encode(_CORPUS, add_special_tokens=False).ids,
        encode(_STALL_PROMPT, add_special_tokens=False).ids,
        interval_s,
    )
    settings = ProxySettings(
        host="127.0.0.1",
        port=0,
        max_streams=100_000,
        drain_timeout_s=2.0,
        write_stall_timeout_s=stall_s,
    )
    server = create_server(ProxyApp(backend, [card], settings), settings)
    await server.start()
    engine = asyncio.create_task(backend.engine())
    loop = asyncio.get_running_loop()
    conn.send(server.port)
    while True:
        cmd = await loop.run_in_executor(None, conn.recv)
        if cmd == "cuts":
            conn.send(cut_clients[:])
            cut_clients.clear()
        elif cmd == "window":
            hist, max_s, tokens = backend.take()
            buffered = sum(
                c.transport.get_write_buffer_size()
                for c in list(server._connections)
                if c.transport is not None and not c.transport.is_closing()
            )
            reply = {
                "hist": hist,
                "max_s": max_s,
                "tokens": tokens,
                "buffered": buffered,
                "open": server.active,
                "warnings": dict(warnings),
            }
            conn.send(reply)
        else:
            break
    await server.shutdown(timeout_s=2.0)
    engine.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await engine


# -- the client (this process) ----------------------------------------------------


def _request(prompt: str, tokens: int) -> bytes:
    body = json.dumps(
        {"model": "bench", "prompt": prompt, "max_tokens": tokens, "stream": True}
    ).encode()
    return (
        b"POST /v1/completions HTTP/1.1\r\nhost: bench\r\ncontent-type: application/json\r\n"
        b"content-length: " + str(len(body)).encode() + b"\r\n\r\n" + body
    )


def _rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


class _Hold:
    """The client side: slots, stalled clients, windows."""

    def __init__(self, conn: Connection, port: int, pid: int, args: argparse.Namespace) -> None:
        self.conn, self.port, self.pid, self.args = conn, port, pid, args
        self.pipe = asyncio.Lock()
        self.done = 0
        self.errors = 0
        self.error_samples: list[str] = []
        self.rss: list[int] = []
        self.hist = _Hist()
        self.warnings: dict[str, int] = {}
        self.stalled_opened = 0

    async def ask(self, cmd: str) -> Any:
        async with self.pipe:
            self.conn.send(cmd)
            return await asyncio.get_running_loop().run_in_executor(None, self.conn.recv)

    async def slot(self, first: bool) -> None:
        loop = asyncio.get_running_loop()
        n = self.args.stream_tokens
        interval = self.args.interval_ms / 1000
        while True:
            tokens = random.randint(1, n) if first else n
            first = False
            fut: asyncio.Future[int] = loop.create_future()
            transport = None
            try:
                async with asyncio.timeout(tokens * interval * 2 + 30):
                    transport, _ = await loop.create_connection(
                        functools.partial(_Stream, _request("go", tokens), fut),
                        "127.0.0.1",
                        self.port,
                    )
                    events = await fut
                if events != tokens + 1:  # one per token, then [DONE]
                    raise RuntimeError(f"{events} events for {tokens} tokens")
                self.done += 1
            except (OSError, RuntimeError, TimeoutError) as exc:
                self.errors += 1
                if isinstance(exc, TimeoutError):
                    why = f"a {tokens}-token stream not done in {tokens * interval * 2 + 30:.0f} s"
                else:
                    why = f"{type(exc).__name__}: {exc}"
                if len(self.error_samples) < 5:
                    self.error_samples.append(why)
            finally:
                if transport is not None:
                    transport.abort()  # a no-op after [DONE]; the hold's end otherwise

    async def stalled(self) -> None:
        """Keep ``--stalled`` clients that never read open; replace the ones the proxy cuts."""
        loop = asyncio.get_running_loop()
        request = _request(_STALL_PROMPT, 10**8)
        socks: dict[str, socket.socket] = {}

        async def open_one() -> None:
            sock = socket.socket()
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, _RCVBUF)
            sock.setblocking(False)
            async with asyncio.timeout(10):
                await loop.sock_connect(sock, ("127.0.0.1", self.port))
                await loop.sock_sendall(sock, request)
            host, port = sock.getsockname()[:2]
            socks[f"{host}:{port}"] = sock
            self.stalled_opened += 1

        try:
            for _ in range(self.args.stalled):
                await open_one()
            while True:
                await asyncio.sleep(1.0)
                for client in await self.ask("cuts"):
                    if (sock := socks.pop(client, None)) is not None:
                        sock.close()
                        await open_one()
        finally:
            for sock in socks.values():
                sock.close()

    async def sample_rss(self) -> None:
        while True:
            self.rss.append(_rss_kib(self.pid))
            await asyncio.sleep(1.0)

    async def run(self) -> list[Window]:
        args = self.args
        tasks = [asyncio.create_task(self.sample_rss())]
        if args.stalled:
            tasks.append(asyncio.create_task(self.stalled()))
        for _ in range(args.streams):
            tasks.append(asyncio.create_task(self.slot(first=True)))
        windows: list[Window] = []
        t0 = time.perf_counter()
        done0 = errors0 = cut0 = 0
        try:
            end = 0.0
            while end < args.hold_s - 1e-9:
                end = min(end + args.window_s, args.hold_s)
                await asyncio.sleep(max(0.0, t0 + end - time.perf_counter()))
                for task in tasks:
                    if task.done() and task.exception() is not None:
                        raise task.exception()  # type: ignore[misc]
                stats = await self.ask("window")
                rss, self.rss = self.rss or [_rss_kib(self.pid)], []
                hist = _Hist(stats["hist"], stats["max_s"])
                self.hist.add(hist)
                self.warnings = stats["warnings"]
                cut = self.warnings.get("http_stream_write_stalled", 0)
                p50, p99, top = hist.percentiles()
                windows.append(
                    Window(
                        end_s=round(time.perf_counter() - t0, 1),
                        tokens=stats["tokens"],
                        streams_done=self.done - done0,
                        errors=self.errors - errors0,
                        added_p50_ms=p50,
                        added_p99_ms=p99,
                        added_max_ms=top,
                        rss_mib=round(rss[-1] / 1024, 1),
                        rss_max_mib=round(max(rss) / 1024, 1),
                        buffered_kib=round(stats["buffered"] / 1024, 1),
                        open_streams=stats["open"],
                        stalled_cut=cut - cut0,
                    )
                )
                done0, errors0, cut0 = self.done, self.errors, cut
                if not args.json:
                    _print_window(windows[-1], header=len(windows) == 1)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        return windows


class _Hist:
    """Added latencies as counts per 1 % bucket (the proxy's histogram), and the largest."""

    def __init__(self, raw: bytes = b"", max_s: float = 0.0) -> None:
        import numpy as np

        self.counts = np.frombuffer(raw, dtype=np.int64) if raw else np.zeros(_H_BUCKETS, np.int64)
        self.max_s = max_s

    def add(self, other: _Hist) -> None:
        self.counts = self.counts + other.counts
        self.max_s = max(self.max_s, other.max_s)

    def percentiles(self) -> tuple[float, float, float]:
        """p50, p99 (a bucket's geometric middle: within 0.5 %) and the max, in ms."""
        import numpy as np

        total = int(self.counts.sum())
        if not total:
            return float("nan"), float("nan"), float("nan")
        cum = np.cumsum(self.counts)
        out = []
        for q in (0.50, 0.99):
            i = int(np.searchsorted(cum, q * total))
            out.append(round(_H_BASE * math.exp((i + 0.5) * _H_STEP) * 1000, 3))
        return out[0], out[1], round(self.max_s * 1000, 3)


def _summary(hold: _Hold, windows: list[Window]) -> dict[str, Any]:
    p50, p99, top = hold.hist.percentiles()
    first, last = windows[0], windows[-1]
    minutes = (last.end_s - first.end_s) / 60
    return {
        "tokens": sum(w.tokens for w in windows),
        "streams_done": sum(w.streams_done for w in windows),
        "errors": hold.errors,
        "error_samples": hold.error_samples,
        "added_p50_ms": p50,
        "added_p99_ms": p99,
        "added_max_ms": top,
        "rss_first_mib": first.rss_mib,
        "rss_last_mib": last.rss_mib,
        "rss_max_mib": max(w.rss_max_mib for w in windows),
        "rss_slope_mib_per_min": round((last.rss_mib - first.rss_mib) / minutes, 2)
        if minutes
        else 0.0,
        "buffered_max_kib": max(w.buffered_kib for w in windows),
        "stalled_opened": hold.stalled_opened,
        "stalled_cut": sum(w.stalled_cut for w in windows),
        "proxy_warnings": hold.warnings,
    }


_COLUMNS = (
    ("end_s", "t s", 6),
    ("tokens", "tokens", 8),
    ("streams_done", "streams", 7),
    ("errors", "errors", 6),
    ("added_p50_ms", "p50 ms", 7),
    ("added_p99_ms", "p99 ms", 7),
    ("added_max_ms", "max ms", 8),
    ("rss_mib", "RSS MiB", 7),
    ("buffered_kib", "buf KiB", 7),
    ("open_streams", "open", 5),
    ("stalled_cut", "cut", 4),
)


def _print_window(window: Window, header: bool) -> None:
    print_columns(_COLUMNS, window, header)


def _print_summary(summary: dict[str, Any]) -> None:
    s = summary
    print(
        f"total: {s['tokens']} tokens, {s['streams_done']} streams, {s['errors']} errors; "
        f"added p50 {s['added_p50_ms']} ms, p99 {s['added_p99_ms']} ms, max {s['added_max_ms']} ms; "
        f"RSS {s['rss_first_mib']} -> {s['rss_last_mib']} MiB ({s['rss_slope_mib_per_min']:+} MiB/min, "
        f"max {s['rss_max_mib']}); buffered max {s['buffered_max_kib']} KiB; "
        f"stalled clients {s['stalled_opened']} opened, {s['stalled_cut']} cut by the proxy"
    )
    for sample in s["error_samples"]:
        print(f"error: {sample}")


def configure(parser: argparse.ArgumentParser) -> None:
    """Add this benchmark's flags to ``parser`` (``star bench proxy-hold`` and ``-m``)."""
    parser.add_argument(
        "--streams", type=int, default=1000, help="streams held open (default %(default)s)"
    )
    parser.add_argument(
        "--hold-s", type=float, default=300.0, help="how long (default %(default)s)"
    )
    parser.add_argument(
        "--interval-ms",
        type=float,
        default=40.0,
        help="per-stream token interval (default %(default)s)",
    )
    parser.add_argument(
        "--stream-tokens",
        type=int,
        default=500,
        help="tokens per stream before its slot opens the next",
    )
    parser.add_argument(
        "--stalled",
        type=int,
        default=10,
        help="extra clients that never read (default %(default)s)",
    )
    parser.add_argument(
        "--write-stall-s",
        type=float,
        default=None,
        help="the proxy's write_stall_timeout_s (default: the setting's default)",
    )
    parser.add_argument(
        "--window-s", type=float, default=30.0, help="report every (default %(default)s)"
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="smoke test: 200 streams, 30 s, 10 s windows, 10 s write stall (flags given win)",
    )
    parser.add_argument("--json", action="store_true", help="print windows and summary as JSON")


_QUICK = {"streams": 200, "hold_s": 30.0, "window_s": 10.0, "write_stall_s": 10.0}


def run(args: argparse.Namespace) -> int:
    """Run the hold described by ``args``; print a table or ``--json``."""
    if args.quick:
        defaults = {"streams": 1000, "hold_s": 300.0, "window_s": 30.0, "write_stall_s": None}
        for key, value in _QUICK.items():
            if getattr(args, key) == defaults[key]:
                setattr(args, key, value)
    if args.write_stall_s is None:
        from star.settings import ProxySettings

        args.write_stall_s = ProxySettings().write_stall_timeout_s
    if (
        not (1 <= args.streams <= 10_000)
        or args.hold_s <= 0
        or args.window_s <= 0
        or args.stream_tokens < 1
    ):
        print(
            f"bench proxy-hold: --streams {args.streams} (1..10000), --hold-s {args.hold_s}, "
            f"--window-s {args.window_s} and --stream-tokens {args.stream_tokens} (> 0)",
            file=sys.stderr,
        )
        return 2
    import tempfile

    import uvloop

    ctx = mp.get_context("spawn")
    ours, theirs = ctx.Pipe()
    with tempfile.TemporaryDirectory(prefix="star-bench-proxy-hold-") as scratch:
        proc = ctx.Process(
            target=_server_main,
            args=(theirs, scratch, args.interval_ms / 1000, args.write_stall_s),
            daemon=True,
        )
        proc.start()
        try:
            if not ours.poll(60):
                print("bench proxy-hold: the proxy did not start within 60 s", file=sys.stderr)
                return 1
            assert proc.pid is not None
            hold = _Hold(ours, ours.recv(), proc.pid, args)
            windows = uvloop.run(hold.run())
            summary = _summary(hold, windows)
        finally:
            with contextlib.suppress(OSError):
                ours.send("stop")
            proc.join(timeout=10)
            if proc.is_alive():
                proc.terminate()
                proc.join(timeout=5)
    config = {
        k: getattr(args, k)
        for k in (
            "streams",
            "hold_s",
            "interval_ms",
            "stream_tokens",
            "stalled",
            "write_stall_s",
            "window_s",
        )
    }
    if args.json:
        print(
            json.dumps(
                {"config": config, "windows": [asdict(w) for w in windows], "summary": summary},
                indent=2,
            )
        )
    else:
        _print_summary(summary)
    return 0 if summary["errors"] == 0 else 1


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m benchmarks.proxy_hold``."""
    return bench_main("benchmarks.proxy_hold", configure, run, __doc__, argv)


if __name__ == "__main__":
    sys.exit(main())
