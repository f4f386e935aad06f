"""Redis for a local fleet: is one answering (at a URL or as the Sentinels' master), or
start a private ``redis-server``."""

from __future__ import annotations

import asyncio
import os
import secrets
import socket
import time
from pathlib import Path
from urllib.parse import quote, urlsplit, urlunsplit

from star.fleet.errors import ClusterError, FleetError
from star.fleet.processes import Child, Launcher
from star.ports import free_port
from star.settings import RedisSettings


def redis_answers(url: str) -> bool:
    parts = urlsplit(url)
    if parts.scheme != "redis":
        return True  # unix sockets / TLS (a plain PING gets no answer): trust the operator's configuration
    try:
        with socket.create_connection(
            (parts.hostname or "127.0.0.1", parts.port or 6379), timeout=1
        ) as sock:
            sock.sendall(b"PING\r\n")
            reply = sock.recv(64)
    except OSError:
        return False
    return reply.startswith(b"+PONG") or reply.startswith(b"-NOAUTH")


def sentinel_master_problem(settings: RedisSettings, timeout_s: float = 5.0) -> str | None:
    """Why the master that ``redis.sentinels`` name for ``redis.service_name`` does not
    answer PING (no Sentinel answers, none names it, it refuses the credentials), or
    None when it does. One try, at most ``timeout_s``: for a check before starting."""
    from redis.exceptions import RedisError

    from star.bus.connection import connect_redis

    async def ping() -> None:
        client = connect_redis(settings)
        try:
            await asyncio.wait_for(client.ping(), timeout_s)
        finally:
            await client.aclose()

    try:
        asyncio.run(ping())
    except (RedisError, OSError, TimeoutError) as exc:
        return str(exc) or type(exc).__name__
    return None


def start_private_redis(
    launcher: Launcher, binary: str, run_dir: Path, timeout_s: float, password: str | None = None
) -> tuple[Child, str]:
    """A ``redis-server`` of one's own on a free loopback port, without persistence
    and with a password (``password``, or one drawn), once it answers PING after
    AUTH (:class:`ClusterError` if it does not within ``timeout_s``).

    Returns the child and the URL, the password in it (``redis://:PASSWORD@...``):
    pass it on in an environment, never on a command line. redis-server reads
    ``requirepass`` from its standard input (``redis-server -``), so the password
    is not in its argv (``ps``, ``/proc/PID/cmdline``) nor in a file.
    """
    password = password or secrets.token_urlsafe(32)
    if not password.isprintable() or any(c in password for c in " \"'\\"):
        raise FleetError("the private Redis's password must be printable, without spaces or quotes")
    port = free_port()
    url = f"redis://:{quote(password, safe='')}@127.0.0.1:{port}/0"
    argv = [binary, "-", "--port", str(port), "--bind", "127.0.0.1", "--save", ""]
    argv += ["--appendonly", "no", "--dir", str(run_dir)]
    child = launcher.start("redis", argv, stdin=f"requirepass {password}\n".encode())
    wait_redis(port, password, launcher, timeout_s)
    return child, url


def without_password(url: str) -> str:
    """``url`` with no user-info password (the user name stays)."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    user = parts.username or ""
    host = parts.netloc.rpartition("@")[2]
    return urlunsplit(parts._replace(netloc=f"{user}@{host}" if user else host))


def write_secret(path: Path, value: str) -> None:
    """``value`` in a new file readable by its owner only (mode 0600)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as out:
        os.fchmod(out.fileno(), 0o600)
        out.write(value + "\n")


def _private_redis_answers(port: int, password: str) -> bool:
    """Whether the redis-server on ``port`` takes ``password`` and answers PING."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1) as sock:
            sock.sendall(f"AUTH {password}\r\nPING\r\n".encode())
            reply = b""
            while b"\r\n" not in reply.partition(b"\r\n")[2]:
                chunk = sock.recv(64)
                if not chunk:
                    break
                reply += chunk
    except OSError:
        return False
    return reply.startswith(b"+OK\r\n+PONG")


def wait_redis(port: int, password: str, launcher: Launcher, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not _private_redis_answers(port, password):
        dead = launcher.dead()
        if dead is not None or time.monotonic() > deadline:
            raise ClusterError(f"private redis-server did not start on 127.0.0.1:{port}")
        time.sleep(0.05)
