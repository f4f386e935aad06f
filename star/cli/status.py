"""``star status``: the cluster now — instances, load, requests, migrations, leader.

The document is :func:`star.fleet.status.collect`'s; this module prints it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
from typing import Any

from star.bus import BusUnavailable
from star.cli.common import CliError, add_settings_args, guarded, settings_from_args
from star.fleet.status import collect
from star.redact import redact_url


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
