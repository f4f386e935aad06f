"""A private ``redis-server`` for tests: ephemeral port, own dir, kill and restart.

AOF with ``appendfsync always`` so a killed server comes back with every
acknowledged write (streams, groups, acks), like a production Redis with AOF.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

from star.ports import free_port  # tests import it from here too


class RedisServer:
    def __init__(self, workdir: Path, persistent: bool = True) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("redis-server is not installed (apt-get install redis-server)")
        self.binary = binary
        self.dir = workdir
        self.port = free_port()
        self.persistent = persistent
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        args = [
            self.binary,
            "--port", str(self.port),
            "--bind", "127.0.0.1",
            "--dir", str(self.dir),
            "--save", "",
            "--daemonize", "no",
            "--logfile", str(self.dir / "redis.log"),
        ]  # fmt: skip
        if self.persistent:
            args += ["--appendonly", "yes", "--appendfsync", "always"]
        else:
            args += ["--appendonly", "no"]
        self.proc = launch(args, self.dir / "redis.log", self._answers)

    def _answers(self) -> bool:
        with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as sock:
            sock.sendall(b"PING\r\n")
            return sock.recv(64).startswith(b"+PONG")

    def kill(self) -> None:
        """SIGKILL, like a crash: no shutdown save."""
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None

    def restart(self) -> None:
        self.kill()
        self.start()

    def stop(self) -> None:
        if self.proc is not None:
            terminate(self.proc)
            self.proc = None


def launch(args: list[str], log: Path, answers: Callable[[], bool]) -> subprocess.Popen[bytes]:
    """Start ``redis-server`` with ``args`` and wait until ``answers()`` (a probe) is true."""
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60  # seconds under heavy load
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"redis-server exited: {log.read_text()[-2000:]}")
        try:
            if answers():
                return proc
        except OSError:
            pass
        time.sleep(0.02)
    raise RuntimeError("redis-server did not answer PING within 60 s")


def terminate(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM, then SIGKILL after 30 s."""
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
