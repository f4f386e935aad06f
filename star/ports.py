"""Free TCP ports that stay free until used.

A port found by binding port 0 comes from the kernel's ephemeral range, the
range outgoing connections take their local ports from. A process that picks
one, then binds it only after an engine has started (tens of seconds, with
gloo, ZMQ, NIXL and Redis opening connections meanwhile), can find it taken:
``star up`` failed with "address already in use" that way. :func:`free_port`
picks below the ephemeral range instead, where no outgoing connection lands,
and :func:`listen` binds at once, keeping the port from the start.

A port another program binds later (vLLM's NIXL side channel, bound by ZMQ
in the engine process while the engine starts) is held by :func:`reserve`
meanwhile: a bound socket that does not listen, with ``SO_REUSEADDR``. Every
other :func:`free_port` on the host skips it (its probe binds without
``SO_REUSEADDR``), while the program's own bind succeeds (ZMQ sets
``SO_REUSEADDR`` on its listeners; Linux lets such sockets share a port while
none listens). Without it a worker's side channel once got the port another
worker's token server had taken in between, and its engine hung at start.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
LOWEST = 10000  # below: well-known and registered services people run


def ephemeral_low(path: Path = EPHEMERAL_RANGE) -> int:
    """First port of the kernel's ephemeral range (32768 where it cannot be read)."""
    try:
        return int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port(host: str = "127.0.0.1", tries: int = 50) -> int:
    """A TCP port free on ``host`` now, outside the ephemeral range where possible."""
    low = ephemeral_low()
    candidates = random.sample(range(LOWEST, low), min(tries, low - LOWEST)) if low > LOWEST else []
    for port in [*candidates, 0]:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind((host, port))
            except OSError:
                continue
            return int(sock.getsockname()[1])
    raise OSError(f"no free TCP port on {host}")


def listen(host: str, port: int = 0) -> socket.socket:
    """A listening socket on ``host:port`` (``0``: a :func:`free_port`), bound now."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port or free_port(host)))
        sock.listen(512)
    except OSError:
        sock.close()
        raise
    return sock


def reserve(host: str = "127.0.0.1") -> socket.socket:
    """A :func:`free_port` held for a server that binds it later (see the module
    docstring); close it once that server listens. The port: ``getsockname()[1]``."""
    for _ in range(50):
        port = free_port(host)
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:  # taken since free_port looked: draw again
            sock.close()
            continue
        return sock
    raise OSError(f"no free TCP port to reserve on {host}")
