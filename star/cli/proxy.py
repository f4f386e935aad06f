"""``star proxy``: the OpenAI-compatible HTTP/SSE front end."""

from __future__ import annotations

import argparse
import socket

import structlog

from star.cli.common import (
    CliError,
    Mirror,
    add_mirrors,
    add_settings_args,
    guarded,
    mirrored,
    settings_from_args,
)
from star.logs import configure_logging
from star.settings import secret_values

CMDLINE_KEY_WARNING = (
    "--api-key is visible to local users in the process list; use STAR_PROXY_API_KEY"
)

# The flags that mirror a setting, made from its rule (star.cli.common.Mirror).
# --model is not one: it names the tokenizer, worker.model when not given.
MIRRORS = (
    Mirror("--host", "proxy.host", "ADDR"),
    Mirror("--port", "proxy.port", "PORT"),
    Mirror(
        "--api-key",
        "proxy.api_key",
        "KEY",
        note="Deprecated: a command line is visible to every local user in the process list; "
        "set STAR_PROXY_API_KEY in the environment (or proxy.api_key in the --config file) instead",
    ),
)


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = sub.add_parser(
        "proxy",
        help="run the OpenAI-compatible HTTP/SSE front end",
        description=(
            "Serve /v1/completions, /v1/chat/completions (streaming and not), /v1/models, "
            "/health and /metrics. Each request is prefilled on a prefill worker and "
            "decoded on a decode worker chosen by the dispatch policy, using the "
            "scheduler's view in <prefix>:load or, without a scheduler, the workers' reports."
        ),
        epilog=(
            "example: STAR_PROXY_API_KEY=$KEY star proxy --port 8000 --model /path/to/model "
            "(give the API key in STAR_PROXY_API_KEY or as proxy.api_key in the --config file: "
            "a key on the command line, --api-key, is visible to every local user in the "
            "process list)"
        ),
    )
    parser.add_argument(
        "--model",
        help="model directory for the tokenizer (default: worker.model, else the tiny demo model)",
    )
    parser.add_argument(
        "--served-model-name", help="model name clients use (default: the --model value)"
    )
    add_mirrors(parser, MIRRORS)
    parser.add_argument(
        "--fd",
        type=int,
        metavar="N",
        help="serve on the listening socket inherited as file descriptor N instead of "
        "binding --host/--port (star up binds the port first, so it is never lost to "
        "another process while the proxy starts)",
    )
    add_settings_args(parser)
    parser.set_defaults(func=guarded(run))


def run(args: argparse.Namespace) -> int:
    settings = settings_from_args(args, mirrored(args, MIRRORS))
    from proxy.service import ProxyService
    from star.model import tiny_model_path

    model = args.model or settings.worker.model or str(tiny_model_path())
    name = args.served_model_name or (
        None if (args.model or settings.worker.model) else "star-tiny"
    )
    configure_logging(settings.log, secrets=secret_values(settings), role="proxy")
    if args.api_key:  # on the command line: /proc/PID/cmdline is world-readable
        structlog.get_logger(__name__).warning(
            "api_key_on_command_line",
            detail=CMDLINE_KEY_WARNING,
        )
    sock = None
    if args.fd is not None:
        try:
            sock = socket.socket(fileno=args.fd)
        except OSError as exc:
            raise CliError(f"--fd {args.fd}: not an open socket ({exc.strerror})") from exc
    return ProxyService(settings, model, name, sock=sock).run()
