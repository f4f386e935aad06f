"""``star scheduler``: run the rescheduler (one leader, any number of hot standbys)."""

from __future__ import annotations

import argparse

from star.cli.common import (
    Mirror,
    add_mirrors,
    add_settings_args,
    guarded,
    mirrored,
    settings_from_args,
)
from star.logs import configure_logging
from star.settings import secret_values

# The flags that mirror a setting, made from its rule (star.cli.common.Mirror).
MIRRORS = (
    Mirror("--mode", "scheduler.mode", "MODE"),
    Mirror("--interval", "scheduler.interval_s", "S"),
    Mirror("--metrics-port", "scheduler.metrics_port", "PORT"),
)


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = sub.add_parser(
        "scheduler",
        help="run the decode rescheduler",
        description=(
            "Consume worker reports from <prefix>:reports, run the rescheduling planner "
            "every interval, publish migration decisions to <prefix>:decisions and the "
            "dispatch view to <prefix>:load. Start several: one leads (Redis lock with a "
            "fencing token), the others are hot standbys that take over within about "
            "lock_ttl_s when the leader dies."
        ),
        epilog="example: star scheduler --mode current --interval 0.5",
    )
    add_mirrors(parser, MIRRORS)
    parser.add_argument("--node", help="this node's name (default: <hostname>-<pid>)")
    add_settings_args(parser)
    parser.set_defaults(func=guarded(run))


def run(args: argparse.Namespace) -> int:
    settings = settings_from_args(args, mirrored(args, MIRRORS))
    from scheduler.service import SchedulerService

    service = SchedulerService(settings, node=args.node)
    configure_logging(
        settings.log, secrets=secret_values(settings), role="scheduler", node=service.node
    )
    return service.run()
