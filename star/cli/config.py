"""``star config show``: the effective configuration and where each value came from.
``star config acl``: the Redis ACL users of a cluster, one per role.
``star config keyring``: the bus's signing keys, one file per role."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from star.bus.acl import ROLES, AclError, acl_file, role_users
from star.bus.signing import new_keyrings
from star.cli.common import CliError, add_settings_args, guarded, settings_from_args
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
    fmt.add_argument("--markdown", action="store_true", help="print the settings table of the docs")
    show.set_defaults(func=guarded(run_show))
    acl = inner.add_parser(
        "acl",
        help="print the Redis ACL users of a cluster, one per role",
        description=(
            "Print a Redis ACL file for the cluster's prefix (bus.prefix): the default "
            "user off and one user per role (worker, scheduler, proxy, operator), each "
            "with only the keys under <prefix>: and the commands that role issues "
            "(docs/operations.md, 'Redis users per role'). Passwords are drawn unless "
            "given; each role's STAR_REDIS_USERNAME / STAR_REDIS_PASSWORD go to stderr, "
            "once (or to --env-dir), so `star config acl > users.acl` keeps them out "
            "of the file, which holds only their SHA-256."
        ),
        epilog=(
            "example: star config acl --prefix star > /etc/redis/users.acl  "
            "(redis.conf: aclfile /etc/redis/users.acl)"
        ),
    )
    add_settings_args(acl)
    acl.add_argument("--prefix", help="the cluster's key prefix (default bus.prefix)")
    acl.add_argument(
        "--password",
        action="append",
        default=[],
        metavar="ROLE=PASSWORD",
        help="a role's password instead of a drawn one (repeatable; a command line is "
        "readable by every local user, prefer the drawn ones)",
    )
    acl.add_argument(
        "--user",
        action="append",
        default=[],
        metavar="ROLE=NAME",
        help="a role's user name (default <prefix>-<role>; repeatable)",
    )
    acl.add_argument(
        "--env-dir",
        metavar="DIR",
        help="write each role's credentials to DIR/<role>.env (mode 0600) instead of stderr",
    )
    acl.add_argument(
        "--setuser",
        action="store_true",
        help="print ACL SETUSER commands (for redis-cli) instead of ACL file lines",
    )
    acl.set_defaults(func=guarded(run_acl))
    keyring = inner.add_parser(
        "keyring",
        help="write the bus's signing keys, one file per role",
        description=(
            "Draw a new set of bus keys and write DIR/<role>.keyring (mode 0600) for "
            "each role (worker, proxy, scheduler, operator). Give each process its "
            "role's file as cluster.keyring (STAR_CLUSTER_KEYRING): it signs what it "
            "writes as that role and checks what it reads against the roles allowed "
            "to write it; a worker's or proxy's file cannot sign a decision, a load "
            "view or a dispatch policy (docs/operations.md, 'Security model'). "
            "cluster.secret stays the token protocol's. Running it again draws new "
            "keys: every process needs its new file."
        ),
        epilog="example: star config keyring --out /etc/star/keys",
    )
    keyring.add_argument("--out", required=True, metavar="DIR", help="folder for the files")
    keyring.set_defaults(func=guarded(run_keyring))


def _per_role(items: list[str], what: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for item in items:
        role, sep, value = item.partition("=")
        if not sep or role not in ROLES or not value:
            # The value may be a password: never quote it.
            raise CliError(f"--{what} takes ROLE=VALUE with ROLE one of {', '.join(ROLES)}")
        out[role] = value
    return out


def run_acl(args: argparse.Namespace) -> int:
    prefix = args.prefix or settings_from_args(args).bus.prefix
    try:
        users = role_users(
            prefix, _per_role(args.password, "password"), _per_role(args.user, "user")
        )
    except AclError as exc:
        raise CliError(str(exc)) from exc
    if args.setuser:
        # The default user last: redis-cli may be running these as it.
        lines = acl_file(users).splitlines()
        lines = [*lines[1:], lines[0]]
        print("\n".join("ACL SETUSER " + line.removeprefix("user ") for line in lines))
    else:
        print(acl_file(users), end="")
    if args.env_dir:
        folder = Path(args.env_dir)
        folder.mkdir(parents=True, exist_ok=True)
        for user in users:
            path = folder / f"{user.role}.env"
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as out:
                os.fchmod(out.fileno(), 0o600)
                out.write(user.env(prefix))
        print(f"star config acl: credentials in {folder}/<role>.env (mode 0600)", file=sys.stderr)
        return 0
    print(
        "# Each role's environment (shown once; the ACL file holds only hashes):",
        file=sys.stderr,
    )
    for user in users:
        print(f"\n# {user.role}\n{user.env(prefix)}", end="", file=sys.stderr)
    return 0


def run_keyring(args: argparse.Namespace) -> int:
    folder = Path(args.out)
    folder.mkdir(parents=True, exist_ok=True)
    for role, ring in new_keyrings().items():
        fd = os.open(folder / f"{role}.keyring", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as out:
            os.fchmod(out.fileno(), 0o600)
            out.write(ring.to_json() + "\n")
    print(
        f"star config keyring: {folder}/<role>.keyring (mode 0600); "
        "give each process its role's as cluster.keyring",
        file=sys.stderr,
    )
    return 0


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
