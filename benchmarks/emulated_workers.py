"""N emulated decode workers for ``star bench scheduler``: schema-valid reports at the real rate.

A worker reports every ``worker.report_every_steps`` decode steps or
``worker.report_interval_s``, whichever comes first, so an instance whose step
takes ``step_ms`` reports every ``min(k * step, interval)`` seconds. Each
instance runs a batch of requests with ShareGPT-like lengths
(:func:`star.sim.workload.synthetic`), generates ``k`` tokens per report,
replaces finished requests and sends a noisy R-hat; batch sizes differ between
instances, so the planner has imbalance to act on. :func:`follow` carries out
the scheduler's decisions as the proxy and the workers would: after an
emulated KV transfer the request leaves its source's batch for its target's
and a ``resumed`` event is published (``refused`` when it is gone).

Bodies are packed straight from the emulated state (``wire.encode`` of a
:class:`Report` cost ~0.7 ms when the messages were dataclasses; it is tens of
µs as msgspec Structs). ``tests/benchmarks/test_scheduler_load.py`` checks
they are byte for byte what ``encode`` writes and that the entries are those
:meth:`Bus.publish` writes.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import time
from dataclasses import dataclass, field
from typing import Any

import msgpack
import msgspec
import numpy as np
import numpy.typing as npt

from star.aio import deadline
from star.bus import Bus, Subscriber
from star.settings import Settings
from star.sim.workload import synthetic
from star.wire import SCHEMA_VERSION, Decision, Event, EventKind, Report
from workers.state import MIN_REMAINING

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]

# An emulated model: Llama-3-8B-like KV (GQA, fp16) and a KV pool of 256K tokens.
BYTES_PER_TOKEN = 2 * 32 * 8 * 128 * 2
CAPACITY_TOKENS = 262_144
PREDICTION_SPREAD = 0.3  # R-hat = true remaining x lognormal(0, spread)
PIPELINE = 64  # reports per round trip at most (~450 KiB at 64 requests each)
LINK_BYTES_PER_S = 25e9 / 8  # an emulated KV transfer link: 25 Gbit/s
HANDSHAKE_S = 0.05  # release, handoff and resume around the transfer
PUBLISHERS = 8  # events of carried-out moves published at once, at most


def _report_fields() -> tuple[tuple[str, Any], ...]:
    """(name, default) of every Report field in order but ``v`` (None where it has no default)."""
    out = []
    for f in msgspec.structs.fields(Report):
        if f.default is not msgspec.NODEFAULT:
            default: Any = f.default
        elif f.default_factory is not msgspec.NODEFAULT:
            default = f.default_factory()
        else:
            default = None
        if f.name != "v":
            out.append((f.name, default))
    return tuple(out)


_REPORT_FIELDS = _report_fields()


@dataclass
class Emulated:
    """One emulated decode instance: its running batch as arrays."""

    name: str
    address: str
    step_s: float
    period_s: float
    steps_per_report: int
    prompt: IntArray
    output: IntArray
    generated: IntArray
    ids: list[str]
    serial: int = 0
    seq: int = 0

    def held(self, request: str) -> tuple[int, int] | None:
        """Where ``request`` sits in the batch and the tokens it holds (None: not here)."""
        try:
            j = self.ids.index(request)
        except ValueError:
            return None
        return j, int(self.prompt[j] + self.generated[j])


@dataclass
class Fleet:
    """N emulated instances and the length pool they draw new requests from."""

    instances: list[Emulated]
    delta: int
    horizon: int
    rng: np.random.Generator
    pool_prompt: IntArray
    pool_output: IntArray
    taus: FloatArray = field(init=False)
    drawn: int = 0

    def __post_init__(self) -> None:
        self.taus = np.arange(self.horizon + 1, dtype=np.float64) * self.delta

    def draw(self, n: int) -> tuple[IntArray, IntArray]:
        idx = (self.drawn + np.arange(n)) % self.pool_prompt.size
        self.drawn += n
        return self.pool_prompt[idx], self.pool_output[idx]


def make_fleet(
    n: int,
    requests: int,
    step_ms: float,
    settings: Settings,
    seed: int,
) -> Fleet:
    """``n`` instances with ``requests`` running on average (0.5x to 1.5x of it)."""
    rng = np.random.default_rng(seed)
    pool = synthetic("sharegpt", max(4096, 4 * n * requests), rng)
    cfg = settings.worker
    fleet = Fleet(
        [],
        settings.scheduler.delta,
        settings.scheduler.horizon,
        rng,
        pool.prompt_tokens.astype(np.int64),
        pool.output_tokens.astype(np.int64),
    )
    for i in range(n):
        batch = max(1, round(requests * rng.uniform(0.5, 1.5)))
        # A bigger batch steps slower (the paper's Fig. 6: linear in batched tokens).
        step_s = step_ms / 1000 * rng.uniform(0.8, 1.2) * (0.75 + 0.25 * batch / max(requests, 1))
        steps = cfg.report_every_steps
        period = min(steps * step_s, cfg.report_interval_s)
        prompt, output = fleet.draw(batch)
        generated = (rng.uniform(0, 1, batch) * output).astype(np.int64)
        inst = Emulated(
            name=f"decode-{i:04d}",
            address=f"127.0.0.1:{20000 + i}",
            step_s=step_s,
            period_s=period,
            steps_per_report=max(1, round(period / step_s)),
            prompt=prompt,
            output=output,
            generated=generated,
            ids=[],
        )
        inst.ids = [_next_id(inst) for _ in range(batch)]
        fleet.instances.append(inst)
    return fleet


def _next_id(inst: Emulated) -> str:
    inst.serial += 1
    return f"{inst.name}-r{inst.serial:07d}"


def advance(fleet: Fleet, inst: Emulated) -> None:
    """Run the instance's batch ``steps_per_report`` decode steps; refill finished slots."""
    inst.generated += inst.steps_per_report
    done = np.flatnonzero(inst.generated >= inst.output)
    if done.size:
        prompt, output = fleet.draw(done.size)
        inst.prompt[done] = prompt
        inst.output[done] = output
        inst.generated[done] = 1  # the first token came from the prefill instance
        for j in done.tolist():
            inst.ids[j] = _next_id(inst)


def migrate(source: Emulated, target: Emulated, request: str) -> int | None:
    """Move ``request`` from ``source``'s batch to the end of ``target``'s; its
    tokens (None: not running on ``source``, finished or moved meanwhile)."""
    held = source.held(request)
    if held is None:
        return None
    j, tokens = held
    target.prompt = np.append(target.prompt, source.prompt[j])
    target.output = np.append(target.output, source.output[j])
    target.generated = np.append(target.generated, source.generated[j])
    target.ids.append(source.ids.pop(j))
    source.prompt = np.delete(source.prompt, j)
    source.output = np.delete(source.output, j)
    source.generated = np.delete(source.generated, j)
    return tokens


def report_body(fleet: Fleet, inst: Emulated, ts: float) -> tuple[bytes, int]:
    """The msgpack body of this instance's report now, and its ``used_tokens``.

    Byte for byte ``wire.encode(Report(...))`` (same key order, plain Python
    numbers), built from arrays without intermediate messages.
    """
    inst.seq += 1
    tokens = inst.prompt + inst.generated
    remaining = (inst.output - inst.generated).astype(np.float64)
    noise = fleet.rng.lognormal(0.0, PREDICTION_SPREAD, remaining.size)
    predicted = np.maximum(np.round(remaining * noise, 1), MIN_REMAINING)
    # workers.state.load_trace, vectorised (integer-valued sums: exact).
    alive = fleet.taus[None, :] < predicted[:, None]
    trace = (alive * (tokens[:, None] + fleet.taus[None, :])).sum(axis=0)
    used = int(tokens.sum())
    requests = [
        {
            "id": rid,
            "tokens": n,
            "generated": g,
            "predicted_remaining": p,
            "migratable": True,
            "true_remaining": None,
        }
        for rid, n, g, p in zip(
            inst.ids, tokens.tolist(), inst.generated.tolist(), predicted.tolist(), strict=True
        )
    ]
    values = {
        "instance": inst.name,
        "role": "decode",
        "seq": inst.seq,
        "ts": ts,
        "address": inst.address,
        "capacity_tokens": CAPACITY_TOKENS,
        "used_tokens": used,
        "bytes_per_token": BYTES_PER_TOKEN,
        "step_time_s": inst.step_s,
        "delta": fleet.delta,
        "trace": trace.tolist(),
        "requests": requests,
        "predictor": True,
    }
    # As encode writes it: the kind, the fields in order (at their defaults where
    # not set here; an unset optional field, e.g. incarnation, left out), the version.
    body = {"k": Report.KIND}
    body.update(
        (name, value)
        for name, default in _REPORT_FIELDS
        if (value := values.get(name, default)) is not msgspec.UNSET
    )
    body["v"] = SCHEMA_VERSION
    return msgpack.packb(body, use_bin_type=True), used


def entry_fields(inst: Emulated, body: bytes, used: int) -> dict[str, bytes | str]:
    """The stream entry :meth:`Bus.publish` writes for this report (``Report.summary``)."""
    return {"kind": Report.KIND, "instance": inst.name, "load": str(used), "body": body}


@dataclass
class GenStats:
    sent: int = 0
    late_s_max: float = 0.0  # how far behind schedule a report went out, worst case
    cpu_s: float = 0.0
    moved: int = 0  # decisions carried out (resumed)
    refused: int = 0  # decisions whose request had left its source


async def follow(bus: Bus, fleet: Fleet, stats: GenStats) -> None:
    """Carry out every decision on the stream until cancelled: after the
    emulated transfer (its KV bytes over :data:`LINK_BYTES_PER_S`, plus
    :data:`HANDSHAKE_S`) the request moves to the target's batch and its
    ``resumed`` event is published, as a proxy says it (``refused`` when the
    request is no longer on its source). Decisions' fences are not checked:
    one scheduler publishes them."""
    by_name = {inst.name: inst for inst in fleet.instances}
    moving: set[asyncio.Task[None]] = set()
    # A tick can decide hundreds of moves (the first at 1,024 instances): their
    # events go out a few at a time, not on hundreds of connections at once.
    publishing = asyncio.Semaphore(PUBLISHERS)

    async def carry_out(d: Decision) -> None:
        source, target = by_name.get(d.source), by_name.get(d.target)
        held = source.held(d.request) if source is not None else None
        tokens = held[1] if held is not None else 0
        await asyncio.sleep(HANDSHAKE_S + tokens * BYTES_PER_TOKEN / LINK_BYTES_PER_S)
        moved = None if source is None or target is None else migrate(source, target, d.request)
        if moved is not None:
            stats.moved += 1
            kind, detail = EventKind.RESUMED, ""
        else:
            stats.refused += 1
            kind, detail = EventKind.REFUSED, "request not running on its source"
        event = Event.now(
            kind, "proxy:bench", request=d.request, migration=d.id, instance=d.target, detail=detail
        )
        async with publishing:
            await bus.publish("events", event)

    try:
        async for entry in Subscriber(bus, "decisions", Decision, start="$"):
            assert isinstance(entry.msg, Decision)
            task = asyncio.create_task(carry_out(entry.msg))
            moving.add(task)
            task.add_done_callback(moving.discard)
    finally:
        for task in moving:
            task.cancel()


async def generate(bus: Bus, fleet: Fleet, stop: asyncio.Event, stats: GenStats) -> None:
    """Publish every instance's reports on its own period until ``stop``.

    One pipeline per wake-up carries every report due then (XADD with the
    bus's approximate MAXLEN, as :meth:`Bus.publish`); a report due while the
    previous pipeline ran goes out late, and the lateness is recorded.
    """
    key = bus.keys.reports
    maxlen = bus.settings.maxlen_reports
    start = time.monotonic()
    due = [
        (start + fleet.rng.uniform(0, inst.period_s), i) for i, inst in enumerate(fleet.instances)
    ]
    heapq.heapify(due)
    cpu0 = time.process_time()
    while not stop.is_set():
        now = time.monotonic()
        at = due[0][0]
        if at > now:
            with contextlib.suppress(TimeoutError):
                async with deadline(at - now):
                    await stop.wait()
            continue
        stats.late_s_max = max(stats.late_s_max, now - at)
        async with bus.redis.pipeline(transaction=False) as pipe:
            ts = time.time()
            for _ in range(PIPELINE):
                if due[0][0] > now:
                    break
                at, i = heapq.heappop(due)
                inst = fleet.instances[i]
                advance(fleet, inst)
                body, used = report_body(fleet, inst, ts)
                pipe.xadd(key, entry_fields(inst, body, used), maxlen=maxlen, approximate=True)  # type: ignore[arg-type]
                # A worker that fell behind reports once, not once per missed period.
                nxt = at + inst.period_s
                heapq.heappush(due, (nxt if nxt > now else now + inst.period_s, i))
                stats.sent += 1
            await pipe.execute()
        stats.cpu_s = time.process_time() - cpu0
