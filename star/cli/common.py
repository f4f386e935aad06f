"""Helpers shared by the subcommands: settings flags and error reporting."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from star.fleet.errors import FleetError
from star.redact import redact_url
from star.settings import (
    Settings,
    SettingsError,
    add_setting_flag,
    load_settings,
    parse_assignment,
)


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


@dataclass(frozen=True)
class Mirror:
    """A command's flag that mirrors setting ``key``: made from the setting's rule
    (:func:`star.settings.add_setting_flag`; type, check, choices, help), None unless
    given, so that the file and STAR_* environment apply below it."""

    flag: str
    key: str
    metavar: str | None = None
    note: str = ""

    @property
    def dest(self) -> str:
        return self.flag.lstrip("-").replace("-", "_")


def add_mirrors(parser: argparse.ArgumentParser, mirrors: Sequence[Mirror]) -> None:
    """Add each of ``mirrors`` to ``parser``."""
    for m in mirrors:
        add_setting_flag(parser, m.flag, m.key, metavar=m.metavar, from_settings=True, note=m.note)


def mirrored(args: argparse.Namespace, mirrors: Sequence[Mirror]) -> dict[str, Any]:
    """``area.key`` -> the value given to its flag (None: not given), for :func:`settings_from_args`."""
    return {m.key: getattr(args, m.dest) for m in mirrors}


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
