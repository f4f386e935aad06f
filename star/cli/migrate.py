"""``star migrate REQUEST --to INSTANCE``: publish a manual migration decision (docs/design.md §5).

REQUEST is the id the client sees (``cmpl-...`` / ``chatcmpl-...``). The
source is looked up in the workers' latest reports unless ``--from`` names it.
The owning proxy reads the decision from ``<prefix>:decisions`` in order; with
``--wait`` the command follows ``<prefix>:events`` until the migration resolves
(``resumed``, ``refused`` or ``aborted``) and exits 0 only on ``resumed``.
The decision and the waiting are :mod:`star.fleet.manual`'s.
"""

from __future__ import annotations

import argparse
import asyncio

from star.bus import BusUnavailable
from star.cli.common import CliError, add_settings_args, guarded, settings_from_args
from star.fleet.manual import migrate
from star.wire import EventKind


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
