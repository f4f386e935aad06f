"""``star.wire`` encode and decode time per message: a 64-request Report, the bus messages, the frames.

Each message is encoded and decoded as its callers do (a Report from the bus
with ``decode(raw, Report)``, a frame with ``decode(raw, FRAMES)``), in this
process, the best of ``--repeat`` runs of ``--number`` calls (the machine's
load only ever adds time). "k last" decodes a Report whose map has its kind
last, as ``star.wire`` wrote it while the messages were dataclasses (the body
of a worker from before then). A frame of the token protocol is also sealed
and opened as a connection with ``cluster.secret`` does (AES-256-GCM,
:class:`star.handshake.Channel`; "seal µs" and "open µs", on top of encode
and decode). Run it from two trees, alternated, to compare::

    python -m benchmarks.wire --repeat 7
"""

from __future__ import annotations

import argparse
import functools
import json
import time
from collections.abc import Callable, Sequence
from typing import Any

import msgpack
import numpy as np

from benchmarks.common import bench_main, text_table
from star.handshake import Channel
from star.wire import (
    FRAMES,
    Decision,
    Event,
    EventKind,
    Generate,
    Handoff,
    LoadEntry,
    Message,
    Report,
    RequestLoad,
    Tokens,
    decode,
    encode,
)


def _report(requests: int) -> Report:
    rng = np.random.default_rng(0)
    loads = [
        RequestLoad(f"cmpl-{i:016x}", int(n), int(g), round(float(p), 1), True, None)
        for i, (n, g, p) in enumerate(
            zip(
                rng.integers(100, 4000, requests),
                rng.integers(1, 1000, requests),
                rng.lognormal(5.0, 1.0, requests),
                strict=True,
            )
        )
    ]
    trace = [float(t) for t in np.linspace(200_000.0, 0.0, 33)]
    return Report(
        "decode-17", "decode", 4711, 1764201600.25, "10.0.0.5:9001", 262_144,
        sum(r.tokens for r in loads), 131_072, 0.025, 32, trace, loads, predictor=True,
    )  # fmt: skip


def _kind_last(raw: bytes) -> bytes:
    """The same map with ``k`` as its last key (how an older ``star.wire`` wrote it)."""
    data = msgpack.unpackb(raw, raw=False)
    data["k"] = data.pop("k")
    return msgpack.packb(data, use_bin_type=True)  # type: ignore[no-any-return]


def cases(requests: int) -> list[tuple[str, Message, Any, bytes]]:
    """(name, message, ``expect`` as its callers pass it, body to decode)."""
    report = _report(requests)
    out: list[tuple[str, Message, Any, bytes]] = [
        (f"report ({requests} requests)", report, Report, encode(report)),
        (f"report ({requests} requests), k last", report, Report, _kind_last(encode(report))),
    ]
    for msg, expect in [
        (
            Decision("d-1", "cmpl-1", "decode-0", "decode-1", 42, -1500.0, "predicted", 1.0),
            Decision,
        ),
        (LoadEntry("decode-0", "decode", "10.0.0.5:9001", 2860, 262_144, 3.25, 3, 1.0), LoadEntry),
        (Event(EventKind.FINISHED, 1.0, "proxy:p1", request="cmpl-1", instance="decode-0"), Event),
        (Tokens(3, [17]), FRAMES),
        (Generate(3, "cmpl-1", list(range(1000)), {"max_tokens": 256, "temperature": 0.0}), FRAMES),
        (
            Handoff(3, "m-1", {"remote_block_ids": list(range(64)), "remote_port": 5600}, 1000),
            FRAMES,
        ),
    ]:
        out.append((msg.KIND, msg, expect, encode(msg)))
    return out


def best_us(fn: Callable[[], object], number: int, repeat: int) -> float:
    """The fastest of ``repeat`` runs of ``number`` calls, in µs per call."""
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        for _ in range(number):
            fn()
        best = min(best, time.perf_counter() - t0)
    return best / number * 1e6


def sealed_us(body: bytes, number: int, repeat: int) -> tuple[float, float]:
    """µs per seal and per open of ``body``, the best of ``repeat`` runs of ``number``
    frames (each run a fresh connection: frames open only in the order sealed)."""
    session = bytes(range(32))
    best_seal = best_open = float("inf")
    for _ in range(repeat):
        proxy, worker = Channel(session, "proxy"), Channel(session, "worker")
        t0 = time.perf_counter()
        sealed = [proxy.seal(body) for _ in range(number)]
        t1 = time.perf_counter()
        for data in sealed:
            worker.open(data)
        t2 = time.perf_counter()
        best_seal, best_open = min(best_seal, t1 - t0), min(best_open, t2 - t1)
    return best_seal / number * 1e6, best_open / number * 1e6


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--requests", type=int, default=64, help="requests in the Report")
    parser.add_argument("--number", type=int, default=0, help="calls per run (0: ~20 ms worth)")
    parser.add_argument("--repeat", type=int, default=5, help="runs; the best is kept")
    parser.add_argument("--json", action="store_true", help="rows as JSON")


def run(args: argparse.Namespace) -> int:
    rows = []
    for name, msg, expect, raw in cases(args.requests):
        assert decode(raw, expect) == msg  # the bodies are valid, and decode to the message
        enc = functools.partial(encode, msg)
        dec = functools.partial(decode, raw, expect)
        number = args.number or max(10, int(20_000 / max(1.0, best_us(enc, 10, 1))))
        seal, open_ = sealed_us(raw, number, args.repeat) if expect is FRAMES else (None, None)
        rows.append(
            {
                "message": name,
                "bytes": len(raw),
                "encode_us": best_us(enc, number, args.repeat),
                "decode_us": best_us(dec, number, args.repeat),
                "seal_us": seal,
                "open_us": open_,
            }
        )
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    table = [["message", "bytes", "encode µs", "decode µs", "seal µs", "open µs"]]
    table += [
        [str(r["message"]), str(r["bytes"]), f"{r['encode_us']:.2f}", f"{r['decode_us']:.2f}"]
        + ["-" if r[k] is None else f"{r[k]:.2f}" for k in ("seal_us", "open_us")]
        for r in rows
    ]
    print(text_table(table, left=1, rule=True))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    return bench_main("benchmarks.wire", configure, run, __doc__, argv)


if __name__ == "__main__":
    raise SystemExit(main())
