"""``star``: one console script, one subcommand per role and tool.

Each subcommand lives in its own module that exposes ``register(subparsers)``;
the module adds its parser and sets ``func=run`` where ``run(args) -> int`` is
the exit status. A command that is not built yet is simply not listed here.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from star import __version__

# Order is the order of `star --help`.
COMMAND_MODULES: tuple[str, ...] = (
    "star.cli.up",
    "star.cli.worker",
    "star.cli.proxy",
    "star.cli.status",
    "star.cli.top",
    "star.cli.config",
    "star.cli.inspect",
    "star.cli.scheduler",
    "star.cli.bench",
    "star.cli.plan",
    "star.cli.migrate",
    "star.cli.model",
    "star.cli.predictor",
    "star.cli.simulate",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="star",
        description=(
            "STAR: decode-phase rescheduling for PD-disaggregated LLM serving. "
            "Workers report predicted remaining lengths, the scheduler migrates "
            "running requests between decode instances, the proxy keeps every "
            "client stream exactly-once."
        ),
        epilog="Run `star COMMAND --help` for the options of one command.",
    )
    parser.add_argument("--version", action="version", version=f"star {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    # `star bench NAME ...`: the benchmark's own parser reads what follows NAME
    # (star.cli.bench), so unknown options are left for it.
    raw = list(sys.argv[1:] if argv is None else argv)
    args, rest = parser.parse_known_args(raw)
    if getattr(args, "command", None) == "bench":
        args.argv = raw[raw.index(args.bench, raw.index("bench") + 1) + 1 :]
    elif rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    func = getattr(args, "func", None)
    if func is None:
        parser.print_help()
        return 2
    try:
        return int(func(args))
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # `star inspect ... | head`
        return 0


if __name__ == "__main__":
    sys.exit(main())
