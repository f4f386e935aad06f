"""``star up``'s private Redis has a password (issue 27 item 2): drawn per cluster,
never on a command line (``/proc/PID/cmdline``), handed to the children in
their environment, and not in the hint ``star up`` prints."""

from __future__ import annotations

import os
import shutil
import socket
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import redis

from star.fleet import Child, Launcher, LocalCluster, start_private_redis

pytestmark = pytest.mark.skipif(shutil.which("redis-server") is None, reason="no redis-server")


def _anonymous_ping(url: str) -> bytes:
    parts = urlsplit(url)
    with socket.create_connection((parts.hostname or "", parts.port or 0), timeout=2) as sock:
        sock.sendall(b"PING\r\n")
        return sock.recv(64)


def _clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("STAR_")}


def test_private_redis_needs_a_password_that_is_not_on_its_command_line(tmp_path: Path) -> None:
    binary = shutil.which("redis-server")
    assert binary is not None
    launcher = Launcher(tmp_path, _clean_env())
    try:
        child, url = start_private_redis(launcher, binary, tmp_path, 30.0)
        password = urlsplit(url).password
        assert password and len(password) >= 32
        assert child.proc is not None
        cmdline = Path(f"/proc/{child.proc.pid}/cmdline").read_bytes()
        assert b"redis-server" in cmdline and password.encode() not in cmdline
        assert password not in " ".join(child.argv)
        assert _anonymous_ping(url).startswith(b"-NOAUTH")
        plain = url.replace(f":{password}@", "")
        with pytest.raises(redis.AuthenticationError):
            redis.Redis.from_url(plain, socket_timeout=2).ping()
        assert redis.Redis.from_url(url, socket_timeout=2).ping()
        # No file of the run directory holds it either (redis-server read it on stdin).
        for path in tmp_path.rglob("*"):
            if path.is_file():
                assert password.encode() not in path.read_bytes(), path
    finally:
        launcher.stop(5)


def test_star_up_hands_the_password_to_children_by_environment_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    started: list[tuple[str, list[str], dict[str, str]]] = []
    real_start = Launcher.start

    def record(self: Launcher, name: str, argv: list[str], *args: Any, **kw: Any) -> Any:
        if name == "redis":
            return real_start(self, name, argv, *args, **kw)
        extra = kw.get("extra_env") or (args[0] if args else None) or {}
        started.append((name, list(argv), {**self.env, **extra}))
        return Child(name, argv, self.run_dir / f"{name}.log")

    monkeypatch.setattr(Launcher, "start", record)
    env = {**_clean_env(), "STAR_REDIS_PASSWORD": "", "STAR_REDIS_USERNAME": "someone"}
    cluster = LocalCluster(None, port=0, prefill=1, decode=2, run_dir=tmp_path, env=env)
    try:
        cluster.start()
        assert cluster.private_redis
        password = cluster.redis_password
        assert len(password) >= 32
        assert {name for name, _, _ in started} == {
            "prefill-0",
            "decode-0",
            "decode-1",
            "scheduler",
            "proxy",
        }
        for name, argv, child_env in started:
            assert password not in " ".join(argv), name
            assert child_env["STAR_REDIS_PASSWORD"] == password
            assert child_env["STAR_REDIS_USERNAME"] == ""
            assert password not in child_env["STAR_REDIS_URL"]
            assert child_env["STAR_REDIS_URL"] == cluster.plain_redis_url
        assert _anonymous_ping(cluster.plain_redis_url).startswith(b"-NOAUTH")

        # The file the hint reads is the owner's alone; the hint shows no password.
        mode = stat.S_IMODE(cluster.redis_password_file.stat().st_mode)
        assert mode == 0o600 and cluster.redis_password_file.read_text().strip() == password
        hint = cluster.find_hint("blue")
        assert password not in hint
        assert f"STAR_REDIS_URL={cluster.plain_redis_url} " in hint
        assert "STAR_BUS_PREFIX=blue " in hint
        # ... and works: a star command run the way it says reaches the private Redis.
        star = f"{sys.executable} -m star.cli.main"
        done = subprocess.run(
            ["bash", "-c", f"{cluster.find_hint('star')}{star} status --json"],
            env=_clean_env(),
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert done.returncode == 0, done.stderr
        assert password not in done.stdout + done.stderr
        # A child started with the cluster's environment finds it the same way.
        status = Launcher(tmp_path, cluster.env)
        probe = real_start(status, "status", [*star.split(), "status", "--json"])
        assert probe.proc is not None and probe.proc.wait(60) == 0, probe.log.read_text()
        status.stop(5)
    finally:
        cluster.stop(5)
