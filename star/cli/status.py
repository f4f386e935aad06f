"""``star status``: the cluster now — instances, load, requests, migrations, leader."""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from typing import Any

from star.bus import Bus, BusUnavailable, as_str
from star.cli.common import CliError, add_settings_args, guarded, settings_from_args
from star.redact import redact_url
from star.settings import Settings
from star.wire import Decision, Event, EventKind, WireError, decode

TERMINAL = {EventKind.RESUMED, EventKind.ABORTED, EventKind.REFUSED, EventKind.EXPIRED}


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = sub.add_parser(
        "status",
        help="show instances, their load and requests, in-flight migrations, the leader",
        description=(
            "Read the bus and print the cluster now: every instance with a fresh report "
            "(role, KV use and capacity, step time, the requests running on it by the id "
            "the client sees), migrations decided but not yet resolved, and the scheduler leader."
        ),
    )
    parser.add_argument("--json", action="store_true", help="print one JSON document")
    add_settings_args(parser)
    parser.set_defaults(func=guarded(run))


def run(args: argparse.Namespace) -> int:
    settings = settings_from_args(args)
    try:
        doc = asyncio.run(collect(settings))
    except BusUnavailable as exc:
        raise CliError(redact_url(str(exc))) from None
    if args.json:
        print(json.dumps(doc, indent=2))
    else:
        print(render(doc))
    return 0


async def collect(settings: Settings) -> dict[str, Any]:
    """The status document (also used by tests and `star up`)."""
    bus = Bus.from_settings(settings.redis, settings.bus)
    try:
        latest = await bus.latest_reports(2000)
        decisions = await bus.tail("decisions", 200)
        events = await bus.tail("events", 2000)
        leader_raw = await bus.retrying("GET", lambda: bus.redis.get(bus.keys.leader))
    finally:
        await bus.close()
    now = time.time()
    instances = []
    for r in sorted(latest.values(), key=lambda r: (r.role, r.instance)):
        age = now - r.ts
        instances.append(
            {
                "instance": r.instance,
                "role": r.role,
                "address": r.address,
                "fresh": age <= settings.scheduler.staleness_s,
                "draining": r.draining,
                # A length predictor loaded (None: not said: a prefill worker or an older build).
                "predictor": r.predictor,
                "age_s": round(age, 2),
                "used_tokens": r.used_tokens,
                "capacity_tokens": r.capacity_tokens,
                "kv_percent": round(100 * r.used_tokens / r.capacity_tokens, 1)
                if r.capacity_tokens
                else 0.0,
                "step_ms": round(r.step_time_s * 1000, 2),
                "waiting": r.waiting,
                "preemptions": r.preemptions,
                # Token-protocol peers that failed the handshake (a wrong cluster.secret, a probe).
                "refused_peers": r.refused_peers,
                "requests": [
                    {
                        "id": q.id,
                        "tokens": q.tokens,
                        "generated": q.generated,
                        "predicted_remaining": q.predicted_remaining,
                        "true_remaining": q.true_remaining,
                    }
                    for q in r.requests
                ],
            }
        )
    resolved: dict[str, str] = {}
    for _id, raw in events:
        ev = _decode(raw)
        if isinstance(ev, Event) and ev.event in TERMINAL and ev.migration:
            resolved[ev.migration] = ev.event.value
    in_flight = []
    recent = []
    for _id, raw in decisions:
        d = _decode(raw)
        if not isinstance(d, Decision):
            continue
        row = {
            "id": d.id,
            "request": d.request,
            "source": d.source,
            "target": d.target,
            "age_s": round(now - d.ts, 2),
            "origin": d.origin,
            "reason": d.reason,
        }
        outcome = resolved.get(d.id)
        if outcome is None and now - d.ts <= settings.scheduler.decision_timeout_s:
            in_flight.append(row)
        recent.append(
            {**row, "outcome": outcome or ("in flight" if row in in_flight else "unknown")}
        )
    leader = None
    if leader_raw:
        node, _, fence = as_str(leader_raw).rpartition("|")
        leader = {"node": node, "fence": int(fence or 0)}
    return {
        "instances": instances,
        "in_flight": in_flight,
        "recent_migrations": recent[-10:],
        "leader": leader,
    }


def _decode(raw: dict[bytes, bytes]) -> object:
    try:
        return decode(raw.get(b"body", b""))
    except WireError:
        return None


def _predictor(loaded: bool | None) -> str:
    """The ``pred`` column: a length predictor loaded, NOT loaded, or not said."""
    return "-" if loaded is None else "yes" if loaded else "NO"


def render(doc: dict[str, Any]) -> str:
    lines = []
    leader = doc["leader"]
    lines.append(
        f"scheduler leader: {leader['node']} (fence {leader['fence']})"
        if leader
        else "scheduler leader: none"
    )
    lines.append("")
    header = f"{'instance':<14} {'role':<8} {'address':<22} {'kv tokens':>18} {'kv%':>6} {'step ms':>8} {'run':>4} {'wait':>5} {'pred':>4}  requests"
    lines.append(header)
    lines.append("-" * len(header))
    if not doc["instances"]:
        lines.append("(no reports on the bus)")
    for i in doc["instances"]:
        stale = "" if i["fresh"] else f"  STALE ({i['age_s']:.0f}s)"
        if i["draining"]:
            stale += "  DRAINING"
        if i["refused_peers"]:
            stale += f"  REFUSED {i['refused_peers']} PEERS"
        reqs = " ".join(f"{q['id']}:{q['tokens']}" for q in i["requests"][:6])
        if len(i["requests"]) > 6:
            reqs += f" (+{len(i['requests']) - 6})"
        lines.append(
            f"{i['instance']:<14} {i['role']:<8} {i['address']:<22} "
            f"{i['used_tokens']:>8}/{i['capacity_tokens']:<9} {i['kv_percent']:>6.1f} {i['step_ms']:>8.2f} "
            f"{len(i['requests']):>4} {i['waiting']:>5} {_predictor(i['predictor']):>4}  {reqs}{stale}"
        )
    lines.append("")
    if doc["in_flight"]:
        lines.append("migrations in flight:")
        for m in doc["in_flight"]:
            lines.append(
                f"  {m['id']} {m['request']}: {m['source']} -> {m['target']} "
                f"({m['age_s']:.1f}s, {m['origin']}, {m['reason']})"
            )
    else:
        lines.append("migrations in flight: none")
    return "\n".join(lines)
