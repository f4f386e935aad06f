"""``star proxy``: the OpenAI-compatible HTTP/SSE front end."""

from __future__ import annotations

import argparse
import socket

from star.cli.common import CliError, add_settings_args, guarded, settings_from_args
from star.logs import configure_logging
from star.settings import secret_values


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
        epilog="example: star proxy --port 8000 --model /path/to/model",
    )
    parser.add_argument("--model", help="model directory for the tokenizer (default: worker.model, else the tiny demo model)")
    parser.add_argument("--served-model-name", help="model name clients use (default: the --model value)")
    parser.add_argument("--host", help="listen address (proxy.host)")
    parser.add_argument("--port", type=int, help="listen port (proxy.port)")
    parser.add_argument("--api-key", help="require this bearer token (proxy.api_key)")
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
    settings = settings_from_args(
        args, {"proxy.host": args.host, "proxy.port": args.port, "proxy.api_key": args.api_key}
    )
    from proxy.service import ProxyService
    from star.model import tiny_model_path

    model = args.model or settings.worker.model or str(tiny_model_path())
    name = args.served_model_name or (None if (args.model or settings.worker.model) else "star-tiny")
    configure_logging(settings.log, secrets=secret_values(settings), role="proxy")
    sock = None
    if args.fd is not None:
        try:
            sock = socket.socket(fileno=args.fd)
        except OSError as exc:
            raise CliError(f"--fd {args.fd}: not an open socket ({exc.strerror})") from exc
    return ProxyService(settings, model, name, sock=sock).run()
