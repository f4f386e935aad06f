"""``star worker``: one vLLM engine (prefill or decode) behind the token protocol."""

from __future__ import annotations

import argparse
import json

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
# --engine-arg is not one: it is repeatable, one KEY=VALUE each (a value may
# hold a comma), where worker.engine_args as a flag value would be a list.
MIRRORS = (
    Mirror("--role", "worker.role"),
    Mirror("--model", "worker.model", "PATH"),
    Mirror("--instance", "worker.instance", "ID"),
    Mirror("--host", "worker.host", "ADDR"),
    Mirror("--port", "worker.port", "PORT"),
)


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
    add_mirrors(parser, MIRRORS)
    parser.add_argument(
        "--engine-arg",
        action="append",
        default=None,
        metavar="KEY=VALUE",
        help="extra vLLM engine argument (repeatable), e.g. --engine-arg block_size=16",
    )
    add_settings_args(parser)
    parser.set_defaults(func=guarded(run))


def run(args: argparse.Namespace) -> int:
    engine_args = json.dumps(args.engine_arg) if args.engine_arg else None
    settings = settings_from_args(
        args, {**mirrored(args, MIRRORS), "worker.engine_args": engine_args}
    )
    from workers.service import WorkerService

    service = WorkerService(settings)
    configure_logging(
        settings.log,
        secrets=secret_values(settings),
        role=settings.worker.role,
        instance=service.instance,
    )
    return service.run()
