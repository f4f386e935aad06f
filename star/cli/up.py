"""``star up``: a whole local cluster in one command (the embedded default).

Redis at the configured URL or, if none answers, a private ``redis-server``;
1 prefill + 3 decode workers on the tiny demo model; the scheduler; the proxy
on 127.0.0.1:8000. Every process runs in its own session so that stopping
(Ctrl-C, SIGTERM, or any process dying) kills whole process groups: vLLM's
engine-core children included, nothing is left behind. Logs go to one file
per process under the run directory.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

from star.cli.common import CliError, add_settings_args, guarded, settings_from_args


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = sub.add_parser(
        "up",
        help="start a local cluster: redis, prefill + decode workers, scheduler, proxy",
        description=(
            "Start a complete local STAR cluster and keep it running until Ctrl-C: "
            "Redis (the configured one, or a private redis-server if none answers), "
            "prefill and decode vLLM workers on the tiny demo model, the scheduler and "
            "the OpenAI-compatible proxy. Prints how to stream a request once it is ready."
        ),
        epilog="example: star up --decode 2 --port 8080",
    )
    parser.add_argument("--prefill", type=int, default=1, help="prefill workers (default 1)")
    parser.add_argument("--decode", type=int, default=3, help="decode workers (default 3)")
    parser.add_argument("--model", help="model directory (default: the tiny demo model)")
    parser.add_argument("--port", type=int, help="proxy port (default proxy.port = 8000)")
    parser.add_argument("--mode", help="scheduler mode (default scheduler.mode)")
    parser.add_argument("--run-dir", help="where logs go (default: a new temporary directory)")
    parser.add_argument("--ready-timeout", type=float, default=600.0, help="seconds to wait for readiness")
    add_settings_args(parser)
    parser.set_defaults(func=guarded(run))


@dataclass
class Child:
    name: str
    argv: list[str]
    log: Path
    proc: subprocess.Popen[bytes] | None = None


@dataclass
class Launcher:
    run_dir: Path
    env: dict[str, str]
    children: list[Child] = field(default_factory=list)

    def start(self, name: str, argv: list[str]) -> Child:
        child = Child(name, argv, self.run_dir / f"{name}.log")
        with child.log.open("wb") as out:
            child.proc = subprocess.Popen(
                argv, stdout=out, stderr=subprocess.STDOUT, env=self.env, start_new_session=True
            )
        self.children.append(child)
        return child

    def dead(self) -> Child | None:
        for child in self.children:
            if child.proc is not None and child.proc.poll() is not None:
                return child
        return None

    def stop(self, timeout_s: float = 20.0) -> None:
        """SIGTERM every process group, wait, then SIGKILL what is left."""
        for child in reversed(self.children):
            _signal_group(child, signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        for child in self.children:
            if child.proc is None:
                continue
            with contextlib.suppress(subprocess.TimeoutExpired):
                child.proc.wait(max(0.1, deadline - time.monotonic()))
        for child in self.children:
            _signal_group(child, signal.SIGKILL)  # engine-core grandchildren too
            if child.proc is not None:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    child.proc.wait(5)


def _signal_group(child: Child, sig: signal.Signals) -> None:
    if child.proc is None:
        return
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(child.proc.pid, sig)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _redis_answers(url: str) -> bool:
    parts = urlsplit(url)
    if parts.scheme not in {"redis", "rediss"}:
        return True  # unix sockets / TLS: trust the operator's configuration
    try:
        with socket.create_connection((parts.hostname or "127.0.0.1", parts.port or 6379), timeout=1) as sock:
            sock.sendall(b"PING\r\n")
            reply = sock.recv(64)
    except OSError:
        return False
    return reply.startswith(b"+PONG") or reply.startswith(b"-NOAUTH")


def _tail(path: Path, lines: int = 25) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def _health(port: int) -> dict[str, object] | None:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as resp:
            return json.loads(resp.read())  # type: ignore[no-any-return]
    except urllib.error.HTTPError as exc:
        with contextlib.suppress(Exception):
            return json.loads(exc.read())  # type: ignore[no-any-return]
        return None
    except (OSError, ValueError):
        return None


class _Stop(Exception):
    pass


def _raise_stop(signum: int, frame: object) -> None:
    raise _Stop(signal.Signals(signum).name)


def run(args: argparse.Namespace) -> int:
    if args.prefill < 1 or args.decode < 1:
        raise CliError("--prefill and --decode must be at least 1")
    settings = settings_from_args(args, {"proxy.port": args.port, "scheduler.mode": args.mode})
    run_dir = Path(args.run_dir or tempfile.mkdtemp(prefix="star-up-"))
    run_dir.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    env.setdefault("STAR_LOG_FORMAT", "json")
    if getattr(args, "config", None):
        env["STAR_CONFIG"] = str(Path(args.config).resolve())
    for item in args.set_:
        key, _, value = item.partition("=")
        env["STAR_" + key.replace(".", "_").upper()] = value
    if args.mode:
        env["STAR_SCHEDULER_MODE"] = args.mode
    launcher = Launcher(run_dir, env)
    port = settings.proxy.port
    star = [sys.executable, "-m", "star.cli.main"]
    model = args.model or settings.worker.model
    model_args = ["--model", model] if model else []

    previous = signal.signal(signal.SIGTERM, _raise_stop)
    try:
        redis_url = settings.redis.url
        if not _redis_answers(redis_url):
            binary = shutil.which("redis-server")
            if binary is None:
                raise CliError(f"no Redis answers at {redis_url} and redis-server is not installed")
            rport = _free_port()
            redis_url = f"redis://127.0.0.1:{rport}/0"
            launcher.start(
                "redis",
                [binary, "--port", str(rport), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", str(run_dir)],
            )
            print(f"star up: no Redis at {settings.redis.url}; started a private one at {redis_url}")
        env["STAR_REDIS_URL"] = redis_url
        for i in range(args.prefill):
            launcher.start(f"prefill-{i}", [*star, "worker", "--role", "prefill", "--instance", f"prefill-{i}", *model_args])
        for i in range(args.decode):
            launcher.start(f"decode-{i}", [*star, "worker", "--role", "decode", "--instance", f"decode-{i}", *model_args])
        launcher.start("scheduler", [*star, "scheduler", "--node", "scheduler-0", "--metrics-port", "0"])
        launcher.start("proxy", [*star, "proxy", "--port", str(port), *model_args])
        print(f"star up: starting {args.prefill} prefill + {args.decode} decode workers, scheduler, proxy (logs: {run_dir})")

        started = time.monotonic()
        last_note = 0.0
        while True:
            dead = launcher.dead()
            if dead is not None:
                print(f"star up: {dead.name} exited with status {dead.proc.returncode if dead.proc else '?'}; last lines of {dead.log}:\n{_tail(dead.log)}", file=sys.stderr)
                return 1
            health = _health(port)
            if health and health.get("ok") and len(health.get("decode", [])) >= args.decode:  # type: ignore[arg-type]
                break
            if time.monotonic() - started > args.ready_timeout:
                print(f"star up: not ready after {args.ready_timeout:.0f}s (health: {health}); logs in {run_dir}", file=sys.stderr)
                return 1
            if time.monotonic() - last_note > 15:
                last_note = time.monotonic()
                print(f"star up: waiting for engines to load ({time.monotonic() - started:.0f}s)...")
            time.sleep(0.5)

        name = "star-tiny" if not model else model
        print(
            f"\nstar up: ready in {time.monotonic() - started:.0f}s — proxy on http://127.0.0.1:{port}\n\n"
            f"  curl -N http://127.0.0.1:{port}/v1/completions -H 'Content-Type: application/json' \\\n"
            f"       -d '{{\"model\": \"{name}\", \"prompt\": \"give me a long list of animals starting with owl.\", \"max_tokens\": 64, \"stream\": true}}'\n\n"
            f"  star status                 # instances, load, running requests\n"
            f"  star inspect decisions -f   # migrations as they are decided\n\n"
            f"Ctrl-C stops everything.",
            flush=True,
        )
        while True:
            dead = launcher.dead()
            if dead is not None:
                print(f"star up: {dead.name} exited; stopping the cluster. Last lines of {dead.log}:\n{_tail(dead.log)}", file=sys.stderr)
                return 1
            time.sleep(0.5)
    except (KeyboardInterrupt, _Stop):
        print("\nstar up: stopping...", flush=True)
        return 0
    finally:
        signal.signal(signal.SIGTERM, previous)
        with contextlib.suppress(KeyboardInterrupt):
            launcher.stop()
        print(f"star up: stopped (logs kept in {run_dir})", flush=True)
