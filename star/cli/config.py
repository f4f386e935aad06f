"""``star config show``: the effective configuration and where each value came from."""

from __future__ import annotations

import argparse
import json

from star.cli.common import add_settings_args, guarded, settings_from_args
from star.settings import as_dict, env_key, render


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = sub.add_parser(
        "config",
        help="show the effective configuration",
        description="Inspect STAR's configuration (defaults < TOML file < STAR_* env < flags).",
    )
    inner = parser.add_subparsers(dest="config_command", metavar="ACTION", required=True)
    show = inner.add_parser(
        "show",
        help="print every setting, its value and where it came from",
        description=(
            "Print every setting with its effective value and its source: default, "
            "the TOML file, an environment variable or a flag. Each key can be set "
            "in the file as [area] key = value, in the environment as "
            "STAR_AREA_KEY, or on any command as --set area.key=value."
        ),
    )
    add_settings_args(show)
    fmt = show.add_mutually_exclusive_group()
    fmt.add_argument("--json", action="store_true", help="print the values as JSON")
    fmt.add_argument("--toml", action="store_true", help="print the values as a TOML file")
    fmt.add_argument("--markdown", action="store_true", help="print the reference table (README)")
    show.set_defaults(func=guarded(run_show))


def run_show(args: argparse.Namespace) -> int:
    settings = settings_from_args(args)
    if args.json:
        print(json.dumps(as_dict(settings), indent=2))
        return 0
    if args.toml:
        current = None
        for key, value, _source, f in settings.items():
            area, name = key.split(".", 1)
            if area != current:
                print(f"{'' if current is None else chr(10)}[{area}]")
                current = area
            print(f"{name} = {render(value, bool(f.metadata.get('secret')))}")
        return 0
    if args.markdown:
        print("| key | default | environment | meaning |")
        print("|---|---|---|---|")
        for key, value, _source, f in settings.items():
            shown = render(value, bool(f.metadata.get("secret"))).replace("|", "\\|")
            print(f"| `{key}` | `{shown}` | `{env_key(key)}` | {f.metadata.get('help', '')} |")
        return 0
    width = max(len(key) for key, *_ in settings.items())
    for key, value, source, f in settings.items():
        shown = render(value, bool(f.metadata.get("secret")))
        print(f"{key:<{width}} = {shown:<28} # {source}")
    return 0
