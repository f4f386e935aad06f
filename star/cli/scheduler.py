"""``star scheduler``: run the rescheduler (one leader, any number of hot standbys)."""

from __future__ import annotations

import argparse

from star.cli.common import add_settings_args, guarded, settings_from_args
from star.logs import configure_logging
from star.settings import secret_values


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
    parser.add_argument("--mode", help="no-migration, current, predicted, oracle or bins:K (scheduler.mode)")
    parser.add_argument("--interval", type=float, help="tick interval in seconds (scheduler.interval_s)")
    parser.add_argument("--node", help="this node's name (default: <hostname>-<pid>)")
    parser.add_argument("--metrics-port", type=int, help="port of /metrics, 0 = off (scheduler.metrics_port)")
    add_settings_args(parser)
    parser.set_defaults(func=guarded(run))


def run(args: argparse.Namespace) -> int:
    settings = settings_from_args(
        args,
        {
            "scheduler.mode": args.mode,
            "scheduler.interval_s": args.interval,
            "scheduler.metrics_port": args.metrics_port,
        },
    )
    from scheduler.service import SchedulerService

    service = SchedulerService(settings, node=args.node)
    configure_logging(settings.log, secrets=secret_values(settings), role="scheduler", node=service.node)
    return service.run()
