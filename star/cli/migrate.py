"""``star migrate REQUEST --to INSTANCE``: publish a manual migration decision (docs/design.md §5).

REQUEST is the id the client sees (``cmpl-...`` / ``chatcmpl-...``). The
source is looked up in the workers' latest reports unless ``--from`` names it.
The owning proxy reads the decision from ``<prefix>:decisions`` in order; with
``--wait`` the command follows ``<prefix>:events`` until the migration resolves
(``resumed``, ``refused`` or ``aborted``) and exits 0 only on ``resumed``.
"""

from __future__ import annotations

import argparse
import asyncio
import time
import uuid

from star.bus import Bus, BusUnavailable, Subscriber
from star.cli.common import CliError, add_settings_args, guarded, settings_from_args
from star.settings import Settings
from star.wire import Decision, Event, EventKind

OUTCOMES = {EventKind.RESUMED, EventKind.REFUSED, EventKind.ABORTED}


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = sub.add_parser(
        "migrate",
        help="move a running request to another decode instance (a manual decision)",
        description=(
            "Publish a decision to <prefix>:decisions that moves REQUEST (the id the client "
            "sees) to INSTANCE. The proxy that owns the request releases it on its source, "
            "continues it on the target through NIXL and reports each step on <prefix>:events."
        ),
        epilog="example: star migrate cmpl-3f2a... --to decode-1 --wait",
    )
    parser.add_argument("request", help="request id as the client sees it")
    parser.add_argument("--to", required=True, dest="target", help="target decode instance")
    parser.add_argument(
        "--from", dest="source", default="", help="source instance (default: from reports)"
    )
    parser.add_argument(
        "--wait", action="store_true", help="wait for the outcome on <prefix>:events"
    )
    parser.add_argument(
        "--timeout", type=float, default=30.0, help="seconds --wait waits (default 30)"
    )
    add_settings_args(parser)
    parser.set_defaults(func=guarded(run))


def run(args: argparse.Namespace) -> int:
    settings = settings_from_args(args)
    try:
        decision, outcome = asyncio.run(
            migrate(settings, args.request, args.target, args.source, args.wait, args.timeout)
        )
    except BusUnavailable as exc:
        raise CliError(str(exc)) from None
    print(
        f"decision {decision.id}: {decision.request} {decision.source or '?'} -> {decision.target}"
    )
    if not args.wait:
        return 0
    if outcome is None:
        print(f"no outcome within {args.timeout:g} s")
        return 1
    print(f"{outcome.event.value}{': ' + outcome.detail if outcome.detail else ''}")
    return 0 if outcome.event is EventKind.RESUMED else 1


async def find_source(bus: Bus, request: str) -> str:
    """The instance whose latest report lists ``request`` ('' if none does)."""
    for report in (await bus.latest_reports()).values():
        if any(r.id == request for r in report.requests):
            return report.instance
    return ""


def manual_decision(request: str, source: str, target: str) -> Decision:
    if not request or not target:
        raise CliError("REQUEST and --to must not be empty")
    if source and source == target:
        raise CliError(f"the request is already on {target}")
    return Decision(
        id=f"manual-{uuid.uuid4().hex[:12]}",
        request=request,
        source=source,
        target=target,
        tick=0,
        delta_v=0.0,
        mode="manual",
        ts=time.time(),
        origin="manual",
    )


async def migrate(
    settings: Settings,
    request: str,
    target: str,
    source: str = "",
    wait: bool = False,
    timeout_s: float = 30.0,
) -> tuple[Decision, Event | None]:
    """Publish the decision; with ``wait``, return the event that resolved it."""
    bus = Bus.from_settings(settings.redis, settings.bus)
    try:
        source = source or await find_source(bus, request)
        decision = manual_decision(request, source, target)
        events = Subscriber(bus, "events", Event, start=await bus.last_id("events"))
        await bus.publish("decisions", decision)
        if not wait:
            return decision, None
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for entry in await events.read(block_ms=200):
                ev = entry.msg
                if isinstance(ev, Event) and ev.migration == decision.id and ev.event in OUTCOMES:
                    return decision, ev
        return decision, None
    finally:
        await bus.close()
