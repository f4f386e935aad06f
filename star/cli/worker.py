"""``star worker``: one vLLM engine (prefill or decode) behind the token protocol."""

from __future__ import annotations

import argparse
import json

from star.cli.common import add_settings_args, guarded, settings_from_args
from star.logs import configure_logging
from star.settings import secret_values


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = sub.add_parser(
        "worker",
        help="run one vLLM engine as a prefill or decode worker",
        description=(
            "Run vLLM's AsyncLLM in process with the NIXL connector, serve the internal "
            "token protocol to proxies, and report the engine's load to <prefix>:reports "
            "every k decode steps and at least every report_interval_s. On CPU machines "
            "the KV cache lives in DRAM (worker.kv_cache_space_gib)."
        ),
        epilog="example: star worker --role decode --instance decode-0 --model ./my-model --engine-arg enforce_eager=true",
    )
    parser.add_argument("--role", choices=["prefill", "decode"], help="worker.role (default decode)")
    parser.add_argument("--model", help="model directory or name (default: the tiny demo model)")
    parser.add_argument("--instance", help="instance id on the bus (default <role>-<host>-<port>)")
    parser.add_argument("--host", help="token protocol address (worker.host)")
    parser.add_argument("--port", type=int, help="token protocol port, 0 = free (worker.port)")
    parser.add_argument(
        "--engine-arg", action="append", default=None, metavar="KEY=VALUE",
        help="extra vLLM engine argument (repeatable), e.g. --engine-arg block_size=16",
    )
    add_settings_args(parser)
    parser.set_defaults(func=guarded(run))


def run(args: argparse.Namespace) -> int:
    settings = settings_from_args(
        args,
        {
            "worker.role": args.role,
            "worker.model": args.model,
            "worker.instance": args.instance,
            "worker.host": args.host,
            "worker.port": args.port,
            "worker.engine_args": json.dumps(args.engine_arg) if args.engine_arg else None,
        },
    )
    from workers.service import WorkerService

    service = WorkerService(settings)
    configure_logging(
        settings.log, secrets=secret_values(settings), role=settings.worker.role, instance=service.instance
    )
    return service.run()
