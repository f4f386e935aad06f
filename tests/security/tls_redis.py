"""A private ``redis-server`` that speaks only TLS and knows one ACL user."""

from __future__ import annotations

import functools
import shutil
import socket
import ssl
import subprocess
import time
from pathlib import Path

from star.ports import free_port
from tests.redis_server import launch, terminate
from tests.security.certs import Pki

USER = "star"
# Recognisable, so a test can look for it in any output.
PASSWORD = "Pw-7f3c9e-hunter2"


def redis_has_tls() -> bool:
    """Whether the installed redis-server was built with TLS (Debian's links OpenSSL)."""
    binary, ldd = shutil.which("redis-server"), shutil.which("ldd")
    if binary is None or ldd is None:
        return False
    return "libssl" in subprocess.run([ldd, binary], capture_output=True, text=True).stdout


class TlsRedisServer:
    """``redis-server --port 0 --tls-port P``, the default user off, ``star`` on with PASSWORD."""

    def __init__(self, workdir: Path, pki: Pki, auth_clients: str = "optional") -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("redis-server is not installed (apt-get install redis-server)")
        self.binary = binary
        self.dir = workdir
        self.pki = pki
        self.auth_clients = auth_clients
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    def url(self, password: str = PASSWORD, user: str = USER) -> str:
        return f"rediss://{user}:{password}@127.0.0.1:{self.port}/0"

    def start(self) -> None:
        args = [
            self.binary,
            "--port", "0",
            "--tls-port", str(self.port),
            "--bind", "127.0.0.1",
            "--tls-cert-file", str(self.pki.server_cert),
            "--tls-key-file", str(self.pki.server_key),
            "--tls-ca-cert-file", str(self.pki.ca),
            "--tls-auth-clients", self.auth_clients,
            "--user", "default", "off",
            "--user", USER, "on", f">{PASSWORD}", "~*", "&*", "+@all",
            "--dir", str(self.dir),
            "--save", "",
            "--appendonly", "no",
            "--daemonize", "no",
            "--logfile", str(self.dir / "redis.log"),
        ]  # fmt: skip
        self.proc = launch(args, self.dir / "redis.log", self._answers)

    @functools.cached_property
    def _client_tls(self) -> ssl.SSLContext:
        context = ssl.create_default_context(cafile=str(self.pki.ca))
        context.load_cert_chain(str(self.pki.client_cert), str(self.pki.client_key))
        return context

    def _answers(self) -> bool:
        with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as raw:
            with self._client_tls.wrap_socket(raw, server_hostname="127.0.0.1") as sock:
                sock.sendall(f"AUTH {USER} {PASSWORD}\r\nPING\r\n".encode())
                time.sleep(0.05)
                return b"+PONG" in sock.recv(256)

    def stop(self) -> None:
        if self.proc is not None:
            terminate(self.proc)
            self.proc = None
