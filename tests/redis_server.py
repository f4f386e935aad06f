"""A private ``redis-server`` for tests: ephemeral port, own dir, kill and restart.

AOF with ``appendfsync always`` so a killed server comes back with every
acknowledged write (streams, groups, acks), like a production Redis with AOF.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
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
        ]
        if self.persistent:
            args += ["--appendonly", "yes", "--appendfsync", "always"]
        else:
            args += ["--appendonly", "no"]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 60  # seconds under heavy load
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited: {(self.dir / 'redis.log').read_text()[-2000:]}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as sock:
                    sock.sendall(b"PING\r\n")
                    if sock.recv(64).startswith(b"+PONG"):
                        return
            except OSError:
                pass
            time.sleep(0.02)
        raise RuntimeError("redis-server did not answer PING within 60 s")

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
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            self.proc = None
