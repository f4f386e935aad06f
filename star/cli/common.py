"""Helpers shared by the subcommands: settings flags and error reporting."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Mapping
from typing import Any

from star.fleet.errors import FleetError
from star.redact import redact_url
from star.settings import Settings, SettingsError, load_settings, parse_assignment


def add_settings_args(parser: argparse.ArgumentParser) -> None:
    """``--config`` and repeatable ``--set AREA.KEY=VALUE`` (see `star config show`)."""
    group = parser.add_argument_group("configuration")
    group.add_argument(
        "--config",
        metavar="PATH",
        help="TOML file with one table per area (default: $STAR_CONFIG, if set)",
    )
    group.add_argument(
        "--set",
        dest="set_",
        action="append",
        default=[],
        metavar="AREA.KEY=VALUE",
        help="override one setting, e.g. --set scheduler.interval_s=0.5 (repeatable)",
    )


def settings_from_args(
    args: argparse.Namespace, flags: Mapping[str, Any] | None = None
) -> Settings:
    """Load settings: defaults < file < STAR_* env < --set < a command's own flags."""
    overrides: dict[str, Any] = {}
    for text in getattr(args, "set_", []) or []:
        key, value = parse_assignment(text)
        overrides[key] = value
    overrides.update({k: v for k, v in (flags or {}).items() if v is not None})
    return load_settings(getattr(args, "config", None), overrides=overrides)


def fail(message: str, status: int = 2) -> int:
    """Print a one-line error for the operator (URL passwords masked) and return the exit status."""
    print(f"star: error: {redact_url(message)}", file=sys.stderr)
    return status


class CliError(Exception):
    """An error the CLI reports in one line (bad input, unreachable service)."""


def guarded(func: Any) -> Any:
    """Turn SettingsError/CliError/FleetError into a one-line message and exit status 2."""

    def run(args: argparse.Namespace) -> int:
        try:
            return int(func(args))
        except (SettingsError, CliError, FleetError) as exc:
            return fail(str(exc))

    run.__doc__ = func.__doc__
    return run
