"""Redis users per role: the least a worker, scheduler, proxy and operator need.

Anything that can write to a cluster's keys steers it: a forged decision moves
a running request, a forged report or load view changes where requests go, a
taken leader lock silences the scheduler. :func:`acl_file` writes one Redis
ACL user per role, each bound to the cluster's prefix (``bus.prefix``), with
only the commands and keys its code issues, and ``default`` off:

========== ============================================ ==========================================
role       writes                                       reads
========== ============================================ ==========================================
worker     ``:reports``, ``:events`` (XADD)             the same two (a retried XADD checks what landed)
scheduler  ``:decisions`` (fenced Lua script),          ``:reports`` (a consumer group: XREADGROUP,
           ``:leader``, ``:fence``, ``:load``,          XACK, XAUTOCLAIM are writes to Redis),
           ``:dispatch``, ``:events``                   ``:events``, ``:decisions``
proxy      ``:events``                                  ``:reports``, ``:decisions``, ``:load``,
                                                        ``:dispatch``
operator   ``:decisions`` (``star migrate``)            every ``<prefix>:*`` key (``star status``,
                                                        ``inspect``, ``top``, ``plan``)
========== ============================================ ==========================================

Every role that decodes what it reads (all but the worker) may also write the
dead-letter stream ``:dead`` and its ``:dead:seen:*`` marks. STAR uses no
Pub/Sub, so no role gets a channel. Key permissions are Redis 7's ``%R~`` /
``%W~``: a proxy holds the decisions stream read-only, so its XADD there is
refused (``NOPERM``) like a worker's; only the scheduler may run scripts
(EVALSHA) or touch ``:leader`` and ``:fence``.
"""

from __future__ import annotations

import hashlib
import re
import secrets
from collections.abc import Mapping
from dataclasses import dataclass

from star.bus.connection import Keys

ROLES = ("worker", "scheduler", "proxy", "operator")

# Sent by redis-py on every connection (SELECT only for a URL's database other
# than 0; AUTH and HELLO need no permission) and by its health check (PING).
_CONNECT = ("ping", "select")
# A reader that cannot decode an entry copies it to <prefix>:dead once, marked
# by a SET NX on <prefix>:dead:seen:<stream>:<id> (star.bus.publish.dead_letter).
_DEAD_LETTER = ("xadd", "set")
# What Subscriber, Bus.tail/since/last_id and a retried publish read.
_STREAM_READ = ("xread", "xrevrange", "xrange")

_COMMANDS: dict[str, tuple[str, ...]] = {
    "worker": (*_CONNECT, "xadd", "xrevrange"),
    "scheduler": (
        *_CONNECT,
        *_STREAM_READ,
        *_DEAD_LETTER,
        # GroupReader on <prefix>:reports
        "xgroup|create",
        "xreadgroup",
        "xautoclaim",
        "xack",
        "xpending",
        # scheduler.leader: the lock, the fence and the fenced XADD are Lua
        # scripts (EVALSHA; SCRIPT LOAD after a NOSCRIPT) calling these
        "evalsha",
        "script|load",
        "get",
        "incr",
        "pexpire",
        "del",
        # a new leader's fence must reach every replica before it is used
        # (scheduler.leader: ROLE, then WAIT)
        "role",
        "wait",
        # Bus.publish_load: MULTI, DEL + HSET + PEXPIRE of :load, SET of :dispatch, EXEC
        "multi",
        "exec",
        "discard",
        "hset",
    ),
    "proxy": (*_CONNECT, *_STREAM_READ, *_DEAD_LETTER, "hgetall", "get"),
    "operator": (
        *_CONNECT,
        *_STREAM_READ,
        *_DEAD_LETTER,
        "hgetall",
        "get",
        # read-only looks a person takes with redis-cli (docs/operations.md)
        "xlen",
        "xinfo|stream",
        "xinfo|groups",
        "xinfo|consumers",
        "xpending",
        "pttl",
    ),
}


@dataclass(frozen=True, slots=True)
class RoleUser:
    """One role's Redis user: its name, password and ACL rules."""

    role: str
    name: str
    password: str
    keys: tuple[str, ...]
    commands: tuple[str, ...]

    def line(self) -> str:
        """The ACL file line (``ACL SETUSER`` takes the same rules after the name)."""
        digest = hashlib.sha256(self.password.encode()).hexdigest()
        rules = ["on", f"#{digest}", "resetkeys", "resetchannels", *self.keys, "-@all"]
        rules += [f"+{c}" for c in self.commands]
        return f"user {self.name} {' '.join(rules)}"

    def env(self, prefix: str) -> str:
        """What this role's processes need in their environment, ``KEY=value`` lines."""
        return (
            f"STAR_REDIS_USERNAME={self.name}\n"
            f"STAR_REDIS_PASSWORD={self.password}\n"
            f"STAR_BUS_PREFIX={prefix}\n"
        )


DEFAULT_OFF = "user default off resetpass resetkeys resetchannels -@all"

# An ACL file line is split at spaces with no quoting: names and patterns
# must not contain white space (nor control characters).
_UNSPLITTABLE = re.compile(r"[\s\x00-\x1f\x7f]")


class AclError(ValueError):
    """A prefix, user name or password an ACL file cannot carry."""


def glob_escape(text: str) -> str:
    """``text`` as a literal in a Redis key pattern (``*?[]\\`` escaped)."""
    return re.sub(r"([*?\[\]\\])", r"\\\1", text)


def key_patterns(role: str, prefix: str) -> tuple[str, ...]:
    """The key permissions of ``role`` on cluster ``prefix``: exact keys where
    the code names them, ``<prefix>:dead:seen:*`` and the operator's reads."""
    k = Keys(glob_escape(prefix))
    dead = (f"%W~{k.dead}", f"%W~{k.dead}:seen:*")
    if role == "worker":
        return (f"~{k.reports}", f"~{k.events}")
    if role == "scheduler":
        owned = (k.reports, k.events, k.decisions, k.leader, k.fence, k.load, k.dispatch)
        return (*(f"~{key}" for key in owned), *dead)
    if role == "proxy":
        read = (k.reports, k.decisions, k.load, k.dispatch)
        return (*(f"%R~{key}" for key in read), f"~{k.events}", *dead)
    if role == "operator":
        return (f"%R~{k.prefix}:*", f"%W~{k.decisions}", *dead)
    raise AclError(f"unknown role {role!r}; roles are {', '.join(ROLES)}")


def role_users(
    prefix: str,
    passwords: Mapping[str, str] | None = None,
    names: Mapping[str, str] | None = None,
) -> list[RoleUser]:
    """One user per role for cluster ``prefix``, named ``<prefix>-<role>`` unless
    ``names`` says otherwise; a password not in ``passwords`` is drawn
    (``secrets.token_urlsafe(32)``)."""
    passwords, names = dict(passwords or {}), dict(names or {})
    for given in (passwords, names):
        unknown = sorted(set(given) - set(ROLES))
        if unknown:
            raise AclError(f"unknown role {unknown[0]!r}; roles are {', '.join(ROLES)}")
    if not prefix or _UNSPLITTABLE.search(prefix):
        raise AclError(f"bus.prefix {prefix!r} cannot go in an ACL file (empty or white space)")
    users = []
    for role in ROLES:
        name = names.get(role) or f"{prefix}-{role}"
        password = passwords.get(role) or secrets.token_urlsafe(32)
        if _UNSPLITTABLE.search(name) or name == "default":
            raise AclError(f"user name {name!r} for {role}: no white space, and not 'default'")
        if _UNSPLITTABLE.search(password):
            raise AclError(f"the password for {role} contains white space or control characters")
        users.append(RoleUser(role, name, password, key_patterns(role, prefix), _COMMANDS[role]))
    if len({u.name for u in users}) != len(users):
        raise AclError("each role needs a user name of its own")
    return users


def acl_file(users: list[RoleUser]) -> str:
    """The ACL file (``aclfile`` in redis.conf): ``default`` off, then one line per role."""
    return "\n".join([DEFAULT_OFF, *(u.line() for u in users)]) + "\n"
