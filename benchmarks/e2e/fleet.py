"""One cell of ``star bench e2e``: a fresh fleet, the seeded workload, what the bus saw.

The fleet is :class:`star.fleet.LocalCluster` (the code path of ``star up``)
with a private ``redis-server``, the regime's settings and the cell's
scheduler mode. A few short requests warm every decode instance's NIXL path
first; then the workload's requests go out at their seeded send times, and
afterwards the run's reports, decisions and events are read back from Redis.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
import uuid
from collections.abc import Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from benchmarks.client import Timing
from benchmarks.e2e.metrics import RequestRecord
from benchmarks.e2e.regimes import Regime
from benchmarks.serve import BenchRequest, drive
from star.wire import Decision, Event, Report, WireError, decode_as

T = TypeVar("T")

WARMUP_REQUESTS = 6
SETTLE_S = 2.0  # after the last response: the last reports land


@dataclass(frozen=True, slots=True)
class CellResult:
    records: list[RequestRecord]
    reports: list[Report]
    decisions: list[Decision]
    events: list[Event]
    t0: float  # wall clock of the first send
    duration_s: float
    ready_s: float


def _decoded(rows: list[tuple[str, dict[bytes, bytes]]], cls: type[Any]) -> list[Any]:
    out = []
    for _id, raw in rows:
        try:
            out.append(decode_as(raw.get(b"body", b""), cls))
        except WireError:
            continue
    return out


async def _read_bus(redis_url: str, prefix: str, seconds: float) -> tuple[list[Any], ...]:
    from star.bus import Bus
    from star.settings import BusSettings, RedisSettings

    bus = Bus.from_settings(RedisSettings(url=redis_url), BusSettings(prefix=prefix))
    try:
        reports = _decoded(await bus.since("reports", seconds), Report)
        decisions = _decoded(await bus.since("decisions", seconds), Decision)
        events = _decoded(await bus.since("events", seconds), Event)
    finally:
        await bus.close()
    return reports, decisions, events


def _records(
    requests: list[BenchRequest], times: list[float], timings: list[Timing]
) -> list[RequestRecord]:
    return [
        RequestRecord(
            index=i,
            request_id=t.request_id,
            sent_s=times[i],
            ok=t.ok,
            max_tokens=requests[i].max_tokens,
            prompt_tokens=t.prompt_tokens,
            output_tokens=t.output_tokens,
            ttft_s=t.ttft_s,
            e2e_s=t.e2e_s,
            tpot_s=t.tpot_s,
            error=t.error,
        )
        for i, t in enumerate(timings)
    ]


def _run(coro: Coroutine[Any, Any, T]) -> T:
    """``uvloop.run(coro)``, cancelled by SIGTERM or SIGINT (then :class:`Terminated`).

    A Python-level signal handler cannot stop a coroutine that uvloop runs
    (its exception is printed and dropped), so the loop's own handlers cancel it.
    """
    import uvloop

    from star.fleet import Terminated

    async def main() -> T:
        task = asyncio.ensure_future(coro)
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, task.cancel)
        try:
            return await task
        finally:
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.remove_signal_handler(sig)

    try:
        return uvloop.run(main())
    except asyncio.CancelledError:
        raise Terminated("interrupted") from None


def run_cell(
    regime: Regime,
    mode: str,
    requests: list[BenchRequest],
    times: list[float],
    extra: dict[str, Any],
    *,
    prefill: int,
    decode: int,
    run_dir: Path,
    bytes_per_token: int,
    timeout_s: float = 300.0,
    ready_timeout_s: float = 600.0,
    progress: bool = False,
) -> CellResult:
    """Bring a fleet up, replay the workload, read the bus back, stop the fleet."""
    from star.fleet import LocalCluster

    prefix = f"e2e-{uuid.uuid4().hex[:8]}"
    env = dict(os.environ)
    env.pop("STAR_REDIS_URL", None)
    env |= regime.env(bytes_per_token)
    env |= {"STAR_SCHEDULER_MODE": mode, "STAR_BUS_PREFIX": prefix}
    run_dir.mkdir(parents=True, exist_ok=True)
    with LocalCluster(
        None, port=0, prefill=prefill, decode=decode, env=env, run_dir=run_dir
    ) as fleet:
        ready_s = fleet.wait_ready(ready_timeout_s)
        warm = [BenchRequest([{"role": "user", "content": "give me a tiny list of animals."}], 4)]
        _run(
            drive(
                fleet.url,
                "chat",
                "star-tiny",
                warm * WARMUP_REQUESTS,
                [0.0] * WARMUP_REQUESTS,
                {},
                {},
                timeout_s,
                False,
            )
        )
        time.sleep(1.0)
        t0 = time.time()
        timings, duration = _run(
            drive(fleet.url, "chat", "star-tiny", requests, times, extra, {}, timeout_s, progress)
        )
        time.sleep(SETTLE_S)
        fleet.check()
        reports, decisions, events = _run(
            _read_bus(fleet.redis_url, prefix, time.time() - t0 + 1.0)
        )
    return CellResult(
        _records(requests, times, timings),
        [r for r in reports if r.ts >= t0 - 1.0],
        [d for d in decisions if d.ts >= t0],
        [e for e in events if e.ts >= t0],
        t0,
        duration,
        ready_s,
    )
