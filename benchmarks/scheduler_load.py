"""``star bench scheduler``: a real ``star scheduler`` and a real ``redis-server``
fed by N emulated decode workers (issue 18, item 5; docs/design.md §7's scheduler row).

Starts a private ``redis-server`` and a ``star scheduler`` subprocess on a
private bus prefix, then publishes schema-valid :class:`~star.wire.Report`
entries for N emulated decode instances at the real rate
(:mod:`benchmarks.emulated_workers`). Measured after every instance is live
in the scheduler's view (or ``--warmup-s``, whichever comes first):

* tick latency p50/p99 (the scheduler's ``star_scheduler_tick_seconds``
  histogram on ``/metrics``: view -> plan -> publish, interpolated within its
  buckets) and how many ticks ran against ``duration / interval``;
* report lag, sampled every ``--sample-s``: the scheduler's consumer group's
  ``lag`` and ``pending`` (XINFO GROUPS) and, in seconds, the age of the last
  entry delivered to it against the stream's newest; it must not grow;
* Redis CPU (``/proc/<pid>/stat``) and memory (``INFO memory``), the
  scheduler's CPU, and stream lengths against their ``MAXLEN``.

The scheduler's CPU per report and per tick is also timed in this process
before anything starts (:func:`cpu_costs`): CPU time, so the machine's load
does not enter, and from it the CPU seconds per second the scheduler needs.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import gc
import json
import math
import os
import shutil
import sys
import tempfile
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from benchmarks.common import bench_main, text_table
from benchmarks.emulated_workers import (
    Emulated,
    GenStats,
    follow,
    generate,
    make_fleet,
    report_body,
)
from star.bus import Bus
from star.logs import stdout_to_stderr
from star.ports import free_port
from star.process import set_gc_gen0_threshold
from star.settings import (
    BusSettings,
    RedisSettings,
    Settings,
    add_setting_flag,
    load_settings,
    parse_assignment,
)
from star.wire import Report

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]

# -- what is measured ----------------------------------------------------------------


def proc_cpu_s(pid: int) -> float:
    """User + system CPU seconds of ``pid`` from /proc (0 if it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


PHASES = ("view", "plan", "publish")  # star_scheduler_tick_phase_seconds


def scrape(port: int) -> dict[str, Any]:
    """The scheduler's /metrics: tick histogram buckets, tick count, gauges, decisions."""
    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    out: dict[str, Any] = {
        "buckets": {},
        "phases": {phase: {} for phase in PHASES},
        "ticks": 0.0,
        "tick_sum": 0.0,
        "decided": 0.0,
    }
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "star_scheduler_tick_seconds_bucket":
                out["buckets"][float(s.labels["le"])] = s.value
            elif s.name == "star_scheduler_tick_phase_seconds_bucket":
                out["phases"][s.labels["phase"]][float(s.labels["le"])] = s.value
            elif s.name == "star_scheduler_tick_seconds_count":
                out["ticks"] = s.value
            elif s.name == "star_scheduler_tick_seconds_sum":
                out["tick_sum"] = s.value
            elif s.name == "star_scheduler_live_instances":
                out["live"] = s.value
            elif s.name == "star_scheduler_leader":
                out["leader"] = s.value
            elif (
                s.name == "star_scheduler_decisions_total" and s.labels.get("outcome") == "decided"
            ):
                out["decided"] += s.value
    return out


def quantile(buckets: dict[float, float], q: float) -> float:
    """``q``-quantile of a cumulative histogram, linear within a bucket
    (Prometheus' ``histogram_quantile``); inf if it lies in the +Inf bucket."""
    edges = sorted(buckets)
    total = buckets[edges[-1]] if edges else 0.0
    if total <= 0:
        return math.nan
    rank = q * total
    lower, below = 0.0, 0.0
    for edge in edges:
        count = buckets[edge]
        if count >= rank:
            if math.isinf(edge):
                return math.inf
            return lower + (edge - lower) * (rank - below) / max(count - below, 1e-12)
        lower, below = edge, count
    return math.inf


def id_ms(entry_id: bytes | str) -> int:
    text = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
    return int(text.split("-", 1)[0])


def _get(info: dict[Any, Any], name: str) -> Any:
    return info.get(name, info.get(name.encode()))


async def sample_redis(bus: Bus, group: str) -> dict[str, Any]:
    """Lag of the scheduler's group, stream lengths, Redis memory."""
    redis = bus.redis
    groups = await redis.xinfo_groups(bus.keys.reports)
    mine = next((g for g in groups if _get(g, "name") in (group, group.encode())), None)
    stream = await redis.xinfo_stream(bus.keys.reports)
    memory = await redis.info("memory")
    lengths = {
        name: int(await redis.xlen(bus.keys.stream(name)))
        for name in ("reports", "decisions", "events")
    }
    out: dict[str, Any] = {"lengths": lengths, "used_memory": int(memory["used_memory"])}
    if mine is not None:
        newest = id_ms(_get(stream, "last-generated-id"))
        delivered = id_ms(_get(mine, "last-delivered-id"))
        lag = _get(mine, "lag")
        read = _get(mine, "entries-read")  # entries delivered to the group (Redis 7)
        out.update(
            entries_read=None if read is None else int(read),
            lag=None if lag is None else int(lag),
            pending=int(_get(mine, "pending")),
            lag_s=max(0.0, (newest - delivered) / 1000),
        )
    return out


def cpu_costs(args: argparse.Namespace, settings: Settings, ticks: int = 3) -> dict[str, float]:
    """The scheduler's CPU work at this size, timed in this process (CPU time,
    so the machine's load does not enter): decoding and applying one report,
    and one tick's view -> plan -> load view. ``demand`` is the CPU seconds per
    second the scheduler needs at the target report rate; above 1 no single
    core keeps up, whatever the load."""
    from star.planner.kernels import warm

    warm()
    fleet = make_fleet(args.instances, args.requests, args.step_ms, settings, args.seed)
    cfg = settings.scheduler
    before = gc.get_threshold()
    set_gc_gen0_threshold(cfg.gc_gen0_threshold)  # as the scheduler process does
    try:
        return _cpu_costs(args, settings, fleet, ticks)
    finally:
        gc.set_threshold(*before)


def _cpu_costs(
    args: argparse.Namespace, settings: Settings, fleet: Any, ticks: int
) -> dict[str, float]:
    from scheduler.view import ClusterView
    from star.planner.core import plan_on
    from star.planner.types import PlannerParams
    from star.wire import decode_as, encode

    cfg = settings.scheduler
    params = PlannerParams.from_settings(settings)
    if args.mode:
        from star.planner.modes import Mode

        params = dataclasses.replace(params, mode=Mode.parse(args.mode))
    # As scheduler.service: each report converts the columns its mode's ticks read.
    view = ClusterView.for_scheduler(cfg, params)
    bodies = [report_body(fleet, inst, time.time())[0] for inst in fleet.instances]
    start = time.process_time()
    for body in bodies:
        view.apply_report(decode_as(body, Report), time.monotonic())
    per_report = (time.process_time() - start) / len(bodies)
    split = {"instances": 0.0, "plan": 0.0, "load": 0.0}
    for _ in range(ticks):
        t0 = time.process_time()
        snapshot = view.snapshot(params)  # as scheduler.service's tick
        t1 = time.process_time()
        result = plan_on(snapshot.arrays, snapshot.ids, snapshot.request, params)
        t2 = time.process_time()
        for entry in view.load_entries(result.workloads, time.time()):
            encode(entry)
        t3 = time.process_time()
        split["instances"] += (t1 - t0) / ticks
        split["plan"] += (t2 - t1) / ticks
        split["load"] += (t3 - t2) / ticks
    per_tick = sum(split.values())
    rate = sum(1 / inst.period_s for inst in fleet.instances)
    interval = args.interval or cfg.interval_s
    return {
        "report_decode_apply_ms": round(per_report * 1e3, 3),
        "tick_cpu_ms": round(per_tick * 1e3, 2),
        **{f"tick_{k}_ms": round(v * 1e3, 2) for k, v in split.items()},
        "cpu_demand": round(rate * per_report + per_tick / interval, 3),
    }


# -- the run -------------------------------------------------------------------------


@dataclass
class Procs:
    run_dir: Path
    redis_url: str
    redis_pid: int
    scheduler_pid: int
    metrics_port: int
    launcher: Any


def start_processes(run_dir: Path, prefix: str, args: argparse.Namespace) -> Procs:
    from star.fleet import ClusterError, Launcher, start_private_redis

    binary = shutil.which("redis-server")
    if binary is None:
        raise SystemExit("redis-server is not installed (apt-get install redis-server)")
    # The emulated workers write unsigned reports (their XADD pipeline is
    # their own): a scheduler with cluster.secret would refuse every one.
    env = {k: v for k, v in os.environ.items() if k != "STAR_CLUSTER_SECRET"}
    launcher = Launcher(run_dir, env)
    try:
        redis, url = start_private_redis(launcher, binary, run_dir, 30.0)
    except ClusterError:
        launcher.stop()
        raise
    metrics_port = free_port()
    # --profile: the scheduler under cProfile (stats written when it stops on SIGTERM).
    profile = ["-m", "cProfile", "-o", str(Path(args.profile).resolve())] if args.profile else []
    argv = [
        sys.executable,
        *profile,
        "-m",
        "star.cli.main",
        "scheduler",
        "--node",
        "bench",
        "--metrics-port",
        str(metrics_port),
    ]
    if args.mode:
        argv += ["--mode", args.mode]
    if args.interval:
        argv += ["--interval", str(args.interval)]
    for assignment in args.scheduler_set:
        argv += ["--set", assignment]
    sched = launcher.start(
        "scheduler",
        argv,
        {"STAR_REDIS_URL": url, "STAR_BUS_PREFIX": prefix, "STAR_LOG_FORMAT": "json"},
    )
    assert redis.proc is not None and sched.proc is not None
    return Procs(run_dir, url, redis.proc.pid, sched.proc.pid, metrics_port, launcher)


async def wait_for(check: Any, timeout_s: float, procs: Procs, poll_s: float = 0.5) -> bool:
    """Poll ``check`` until it is true (True) or ``timeout_s`` passed (False)."""
    deadline = time.monotonic() + timeout_s
    while True:
        dead = procs.launcher.dead()
        if dead is not None:
            raise RuntimeError(f"{dead.name} exited; see {dead.log}")
        with contextlib.suppress(OSError, ValueError):
            if await check():
                return True
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(poll_s)


async def measure(
    args: argparse.Namespace, procs: Procs, prefix: str, settings: Settings
) -> dict[str, Any]:
    from tqdm import tqdm

    # A generous timeout: on a loaded machine a pipeline of reports can take seconds.
    bus = Bus.from_settings(
        RedisSettings(url=procs.redis_url, socket_timeout_s=60.0), BusSettings(prefix=prefix)
    )
    group = f"{settings.scheduler.group}:bench"
    fleet = make_fleet(args.instances, args.requests, args.step_ms, settings, args.seed)
    stop = asyncio.Event()
    gen = GenStats()

    async def metrics() -> dict[str, Any]:
        return await asyncio.to_thread(scrape, procs.metrics_port)

    async def leading() -> bool:
        return (await metrics()).get("leader") == 1.0

    if not await wait_for(leading, 120.0, procs):
        raise RuntimeError(f"the scheduler did not lead within 120 s (logs in {procs.run_dir})")
    generator = asyncio.create_task(generate(bus, fleet, stop, gen))
    # Decisions carried out (moves resolve, as on a fleet) unless --no-follow.
    follower = None if args.no_follow else asyncio.create_task(follow(bus, fleet, gen))
    try:

        async def all_live() -> bool:
            if generator.done():
                generator.result()
            return (await metrics()).get("live", 0) >= args.instances

        warm_started = time.monotonic()
        # A scheduler that cannot keep up never sees them all: measured anyway.
        all_seen = await wait_for(all_live, args.warmup_s, procs)
        warmup_s = time.monotonic() - warm_started
        base = await metrics()
        base["entries_read"] = (await sample_redis(bus, group)).get("entries_read")
        sent0, t0 = gen.sent, time.monotonic()
        moved0, refused0 = gen.moved, gen.refused
        cpu0 = {"redis": proc_cpu_s(procs.redis_pid), "scheduler": proc_cpu_s(procs.scheduler_pid)}
        samples: list[dict[str, Any]] = []
        bar = tqdm(total=int(args.duration), unit="s", disable=args.no_progress, file=sys.stderr)
        try:
            while (elapsed := time.monotonic() - t0) < args.duration:
                await asyncio.sleep(min(args.sample_s, max(0.0, args.duration - elapsed)))
                if generator.done():
                    generator.result()
                if procs.launcher.dead() is not None:
                    raise RuntimeError(
                        f"{procs.launcher.dead().name} exited (logs in {procs.run_dir})"
                    )
                row = await sample_redis(bus, group)
                now = await metrics()
                row["t"] = round(time.monotonic() - t0, 2)
                row["ticks"] = now["ticks"] - base["ticks"]
                row["live"] = int(now.get("live", 0))
                row["leader"] = int(now.get("leader", 0))
                row["load1"] = os.getloadavg()[0]
                samples.append(row)
                bar.update(min(int(row["t"]), int(args.duration)) - bar.n)
                bar.set_postfix(lag_s=row.get("lag_s"), lag=row.get("lag"), refresh=False)
        finally:
            bar.close()
        wall = time.monotonic() - t0
        final = await metrics()
        cpu1 = {"redis": proc_cpu_s(procs.redis_pid), "scheduler": proc_cpu_s(procs.scheduler_pid)}
        sent = gen.sent - sent0
        moves = {"resumed": gen.moved - moved0, "refused": gen.refused - refused0}
    finally:
        stop.set()
        with contextlib.suppress(Exception):
            await generator
        if follower is not None:
            follower.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await follower
        await bus.close()
    result = summarise(args, settings, base, final, samples, wall, warmup_s, sent, cpu0, cpu1, gen)
    result["all_live_after_warmup"] = all_seen
    result["moves_followed"] = None if args.no_follow else moves
    return result


def slope(xs: list[float], ys: list[float]) -> float:
    """Least-squares slope of ys over xs (0 with fewer than two points)."""
    if len(xs) < 2:
        return 0.0
    return float(np.polyfit(np.asarray(xs), np.asarray(ys), 1)[0])


def summarise(
    args: argparse.Namespace,
    settings: Settings,
    base: dict[str, Any],
    final: dict[str, Any],
    samples: list[dict[str, Any]],
    wall: float,
    warmup_s: float,
    sent: int,
    cpu0: dict[str, float],
    cpu1: dict[str, float],
    gen: GenStats,
) -> dict[str, Any]:
    def since_base(
        final_buckets: dict[float, float], base_buckets: dict[float, float]
    ) -> dict[float, float]:
        return {le: n - base_buckets.get(le, 0.0) for le, n in final_buckets.items()}

    buckets = since_base(final["buckets"], base["buckets"])
    phases = {p: since_base(final["phases"][p], base["phases"][p]) for p in PHASES}
    ticks = final["ticks"] - base["ticks"]
    interval = args.interval or settings.scheduler.interval_s
    lags = [s for s in samples if "lag_s" in s]
    ts = [s["t"] for s in lags]
    half = len(lags) // 2
    maxlen = {
        "reports": settings.bus.maxlen_reports,
        "decisions": settings.bus.maxlen_decisions,
        "events": settings.bus.maxlen_events,
    }
    longest = {k: max((s["lengths"][k] for s in samples), default=0) for k in maxlen}
    lag_slope = slope(ts, [s["lag_s"] for s in lags]) * 60  # lag seconds per minute
    # Entries added but not read (XINFO GROUPS lag): once MAXLEN trims entries the
    # group never read, lag_s is capped by the stream's window but this keeps growing.
    entries_slope = slope(ts, [float(s.get("lag") or 0) for s in lags]) * 60
    tick_p99 = quantile(buckets, 0.99)
    # Reports the scheduler read, and its CPU per report read: comparable
    # between runs even when the machine's load decides how much CPU it got.
    first_read, last_read = (
        base.get("entries_read"),
        samples[-1].get("entries_read") if samples else None,
    )
    read = last_read - first_read if first_read is not None and last_read is not None else None
    sched_cpu = cpu1["scheduler"] - cpu0["scheduler"]
    result = {
        "instances": args.instances,
        "requests_per_instance": args.requests,
        "step_ms": args.step_ms,
        "duration_s": round(wall, 1),
        "warmup_s": round(warmup_s, 1),
        "interval_s": interval,
        "reports_per_s": round(sent / wall, 1),
        "reports_per_s_target": round(sum(1 / i.period_s for i in _periods(args, settings)), 1),
        "generator_late_max_s": round(gen.late_s_max, 3),
        "ticks": int(ticks),
        "ticks_expected": int(wall / interval),
        "tick_p50_ms": round(quantile(buckets, 0.5) * 1000, 2),
        "tick_p99_ms": round(tick_p99 * 1000, 2),
        "tick_mean_ms": round((final["tick_sum"] - base["tick_sum"]) / max(ticks, 1) * 1000, 2),
        # Where a tick's time goes (the leader's ticks publish; a standby's do not).
        "tick_phase_p50_p99_ms": {
            p: [round(quantile(b, q) * 1000, 2) for q in (0.5, 0.99)] for p, b in phases.items()
        },
        "live_min": min((s["live"] for s in samples), default=0),
        "leader_lost_samples": sum(1 for s in samples if not s["leader"]),
        "decisions": int(final["decided"] - base["decided"]),
        # On the stream since the scheduler started (warm-up included).
        "decisions_published": samples[-1]["lengths"]["decisions"] if samples else 0,
        "lag_s_first_half_max": round(max((s["lag_s"] for s in lags[:half]), default=0.0), 3),
        "lag_s_second_half_max": round(max((s["lag_s"] for s in lags[half:]), default=0.0), 3),
        "lag_s_last": round(lags[-1]["lag_s"], 3) if lags else None,
        "lag_entries_max": max((s.get("lag") or 0 for s in lags), default=0),
        "pending_max": max((s.get("pending", 0) for s in lags), default=0),
        "lag_s_slope_per_min": round(lag_slope, 4),
        "lag_entries_slope_per_min": round(entries_slope, 1),
        "redis_cpu_pct": round(100 * (cpu1["redis"] - cpu0["redis"]) / wall, 1),
        "scheduler_cpu_pct": round(100 * sched_cpu / wall, 1),
        "reports_read_per_s": None if read is None else round(read / wall, 1),
        "scheduler_cpu_ms_per_report_read": (round(1000 * sched_cpu / read, 3) if read else None),
        "generator_cpu_pct": round(100 * gen.cpu_s / (wall + warmup_s), 1),
        "redis_used_memory_mib_max": round(
            max((s["used_memory"] for s in samples), default=0) / 2**20, 1
        ),
        "stream_max_len": longest,
        "stream_maxlen": maxlen,
        "load1_mean": round(float(np.mean([s["load1"] for s in samples])), 2) if samples else None,
        "cpus": os.cpu_count(),
    }
    # No lag growth: over the run the lag grows by less than one tick interval
    # (in seconds) and one tick's reports (in entries), and stays under a second.
    result["lag_grows"] = bool(
        lag_slope * wall / 60 > interval
        or result["lag_s_second_half_max"] > 1.0
        or entries_slope * wall / 60 > max(result["reports_per_s"] * interval, 1.0)
    )
    # Approximate trimming (MAXLEN ~) cuts whole macro-nodes: up to 100 entries over.
    result["streams_bounded"] = all(longest[k] <= maxlen[k] + 100 for k in maxlen)
    result["tick_p99_ok"] = bool(tick_p99 <= 0.1)
    result["samples"] = samples
    return result


def _periods(args: argparse.Namespace, settings: Settings) -> list[Emulated]:
    # The same draws as the run's fleet (same seed): the target rate.
    return make_fleet(args.instances, args.requests, args.step_ms, settings, args.seed).instances


def print_table(r: dict[str, Any]) -> None:
    rows = [
        ("instances x requests", f"{r['instances']} x ~{r['requests_per_instance']}", ""),
        ("reports/s (target)", f"{r['reports_per_s']} ({r['reports_per_s_target']})", ""),
        (
            "live instances min, samples not leading",
            f"{r['live_min']}, {r['leader_lost_samples']}",
            "all live after warm-up: " + ("yes" if r["all_live_after_warmup"] else "NO"),
        ),
        ("ticks (expected)", f"{r['ticks']} ({r['ticks_expected']})", ""),
        (
            "tick p50 / p99 / mean",
            f"{r['tick_p50_ms']} / {r['tick_p99_ms']} / {r['tick_mean_ms']} ms",
            "p99 <= 100 ms: " + ("ok" if r["tick_p99_ok"] else "MISSED"),
        ),
        (
            "tick p50 / p99 by phase: view, plan, publish",
            ", ".join(f"{p50} / {p99}" for p50, p99 in r["tick_phase_p50_p99_ms"].values()) + " ms",
            "",
        ),
        (
            "decisions (on the stream)",
            f"{r['decisions']} ({r['decisions_published']})",
            "not carried out (--no-follow)"
            if r["moves_followed"] is None
            else "carried out: {resumed} resumed, {refused} refused".format(**r["moves_followed"]),
        ),
        (
            "report lag s: 1st / 2nd half max",
            f"{r['lag_s_first_half_max']} / {r['lag_s_second_half_max']}",
            "no growth: " + ("MISSED" if r["lag_grows"] else "ok"),
        ),
        (
            "lag slope s/min, entries/min; entries max, pending max",
            f"{r['lag_s_slope_per_min']}, {r['lag_entries_slope_per_min']}; "
            f"{r['lag_entries_max']}, {r['pending_max']}",
            "",
        ),
        (
            "reports read/s; scheduler CPU ms per report read",
            f"{r['reports_read_per_s']}; {r['scheduler_cpu_ms_per_report_read']}",
            "",
        ),
        (
            "CPU % redis / scheduler / generator",
            f"{r['redis_cpu_pct']} / {r['scheduler_cpu_pct']} / {r['generator_cpu_pct']}",
            "",
        ),
        ("redis used_memory max", f"{r['redis_used_memory_mib_max']} MiB", ""),
        (
            "stream max len (MAXLEN)",
            ", ".join(f"{k} {v} ({r['stream_maxlen'][k]})" for k, v in r["stream_max_len"].items()),
            "bounded: " + ("ok" if r["streams_bounded"] else "MISSED"),
        ),
        (
            "CPU ms: per report (decode+apply), per tick",
            f"{r['cpu_costs']['report_decode_apply_ms']}, {r['cpu_costs']['tick_cpu_ms']} (view {r['cpu_costs']['tick_instances_ms']}, plan {r['cpu_costs']['tick_plan_ms']}, load view {r['cpu_costs']['tick_load_ms']})",
            "",
        ),
        (
            "CPU s/s the scheduler needs",
            str(r["cpu_costs"]["cpu_demand"]),
            "one core keeps up: " + ("yes" if r["cpu_costs"]["cpu_demand"] < 1 else "NO"),
        ),
        ("load average (cpus)", f"{r['load1_mean']} ({r['cpus']})", ""),
    ]
    print(
        f"star bench scheduler: {r['duration_s']} s after a {r['warmup_s']} s warm-up, interval {r['interval_s']} s"
    )
    print(text_table(rows, left=3, indent="  "))


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--instances", type=int, default=1024, help="emulated decode workers")
    parser.add_argument(
        "--duration", type=float, default=600.0, help="measured seconds (after warm-up)"
    )
    parser.add_argument(
        "--requests",
        type=int,
        default=64,
        help="running requests per instance, on average (0.5x-1.5x)",
    )
    parser.add_argument(
        "--step-ms",
        type=float,
        default=25.0,
        help="mean decode step time; sets the report rate with worker.report_every_steps / report_interval_s",
    )
    add_setting_flag(parser, "--mode", "scheduler.mode", metavar="MODE", from_settings=True)
    add_setting_flag(parser, "--interval", "scheduler.interval_s", metavar="S", from_settings=True)
    parser.add_argument(
        "--scheduler-set",
        action="append",
        default=[],
        metavar="AREA.KEY=VALUE",
        help="a setting for the scheduler process, passed as its --set (repeatable); "
        "the in-process CPU costs use it too, e.g. scheduler.gc_gen0_threshold=700",
    )
    parser.add_argument(
        "--warmup-s",
        type=float,
        default=60.0,
        help="at most this long for every instance to be live in the scheduler's view",
    )
    parser.add_argument("--sample-s", type=float, default=5.0, help="seconds between lag samples")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--no-follow",
        action="store_true",
        help="the emulated workers ignore decisions (moves then end only by expiring); "
        "by default each is carried out after an emulated KV transfer and its resumed "
        "event published",
    )
    parser.add_argument(
        "--profile", metavar="PATH", help="run the scheduler under cProfile, stats to PATH"
    )
    parser.add_argument("--keep", action="store_true", help="keep the run directory (logs)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")


def run(args: argparse.Namespace) -> int:
    """Run the benchmark described by ``args``; print a table or ``--json``."""
    settings = load_settings(overrides=dict(map(parse_assignment, args.scheduler_set)))
    prefix = f"bench-sched-{os.getpid()}"
    run_dir = Path(tempfile.mkdtemp(prefix="star-bench-scheduler-"))
    costs = cpu_costs(args, settings)  # before the processes start: nothing else runs here
    procs = start_processes(run_dir, prefix, args)
    try:
        with stdout_to_stderr():  # this process's own warnings: stdout is the table or --json
            result = asyncio.run(measure(args, procs, prefix, settings))
        result["cpu_costs"] = costs
        result["scheduler_set"] = args.scheduler_set
    finally:
        procs.launcher.stop()
        if not args.keep:
            shutil.rmtree(run_dir, ignore_errors=True)
    if args.json:
        print(json.dumps(result))
    else:
        print_table(result)
        if args.keep:
            print(f"  logs: {run_dir}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m benchmarks.scheduler_load``."""
    return bench_main("benchmarks.scheduler_load", configure, run, __doc__, argv)


if __name__ == "__main__":
    sys.exit(main())
