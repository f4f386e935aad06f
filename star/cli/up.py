"""``star up``: a whole local cluster in one command (the embedded default).

Redis at the configured URL or, if none answers, a private ``redis-server``;
1 prefill + 3 decode workers on the tiny demo model; the scheduler; the proxy
on 127.0.0.1:8000. Every process runs in its own session so that stopping
(Ctrl-C, SIGTERM, or any process dying) kills whole process groups: vLLM's
engine-core children included, nothing is left behind; a ``star up`` killed
outright (SIGKILL) takes them along too (``PR_SET_PDEATHSIG``). A cluster
already live on the same Redis and prefix is refused, named, rather than
joined. Logs go to one file per process under the run directory; a process
that dies is reported by its one-line cause.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import json
import os
import secrets
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING
from urllib.parse import quote, urlsplit, urlunsplit

from star.cli.common import CliError, add_settings_args, guarded, settings_from_args
from star.ports import free_port, listen
from star.redact import redact_url
from star.settings import BusSettings, Settings, env_key

if TYPE_CHECKING:
    from star.bus import Bus


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
    parser.add_argument(
        "--ready-timeout", type=float, default=600.0, help="seconds to wait for readiness"
    )
    add_settings_args(parser)
    parser.set_defaults(func=guarded(run))


@dataclass
class Child:
    name: str
    argv: list[str]
    log: Path
    proc: subprocess.Popen[bytes] | None = None
    extra_env: dict[str, str] = field(default_factory=dict)
    pass_fds: tuple[int, ...] = ()  # inherited descriptors (the proxy's listening socket)


@dataclass
class Launcher:
    run_dir: Path
    env: dict[str, str]
    children: list[Child] = field(default_factory=list)

    def start(
        self,
        name: str,
        argv: list[str],
        extra_env: dict[str, str] | None = None,
        pass_fds: tuple[int, ...] = (),
        stdin: bytes | None = None,
    ) -> Child:
        """Start ``argv`` in a session of its own; ``stdin``, if given, is written
        to its standard input, which is then closed (a secret it must not see
        on its command line, where every local user can read it)."""
        child = Child(
            name, argv, self.run_dir / f"{name}.log", None, dict(extra_env or {}), pass_fds
        )
        with child.log.open("wb") as out:
            child.proc = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL if stdin is None else subprocess.PIPE,
                stdout=out,
                stderr=subprocess.STDOUT,
                env={**self.env, **(extra_env or {})},
                start_new_session=True,
                pass_fds=pass_fds,
                preexec_fn=_die_with_parent(),
            )
        self.children.append(child)
        if stdin is not None:
            assert child.proc.stdin is not None
            with contextlib.suppress(BrokenPipeError):
                child.proc.stdin.write(stdin)
            child.proc.stdin.close()
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
        # SIGKILL is asynchronous: return once no member of any group is left
        # (a killed process on a loaded host can take seconds to be reaped).
        groups = {c.proc.pid for c in self.children if c.proc is not None}
        deadline = time.monotonic() + 30
        while group_members(groups) and time.monotonic() < deadline:
            time.sleep(0.05)


def group_members(groups: set[int]) -> list[tuple[int, int, str]]:
    """(pid, process group, name) of the live (non-zombie) processes in ``groups``.

    Reads ``/proc`` (Linux); elsewhere it only checks the groups' leaders.
    """
    proc = Path("/proc")
    if not (proc / "self" / "stat").exists():
        alive = []
        for pgid in groups:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pgid, 0)
                alive.append((pgid, pgid, "?"))
        return alive
    out = []
    for stat in proc.glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:
            continue  # exited while we looked
        fields = text[text.rindex(")") + 2 :].split()
        if fields[0] != "Z" and int(fields[2]) in groups:
            name = text[text.index("(") + 1 : text.rindex(")")]
            out.append((int(stat.parent.name), int(fields[2]), name))
    return out


PR_SET_PDEATHSIG = 1  # linux/prctl.h


def _die_with_parent() -> Callable[[], None] | None:
    """A ``preexec_fn`` that has the kernel SIGKILL the child when this process dies.

    Each child runs in its own session, so a SIGKILL of this process (which
    no handler sees) reaches none of them: without this they ran on, engines
    and all. The kernel sends the signal when the *thread* that forked exits,
    so only children started from the main thread get it (it lives as long as
    the process). A worker's engine core ends itself once the worker is gone
    (``workers.parent.end_with_parent``). Linux only; None elsewhere.
    """
    if not sys.platform.startswith("linux"):
        return None
    if threading.current_thread() is not threading.main_thread():
        return None
    prctl = ctypes.CDLL(None, use_errno=True).prctl
    parent = os.getpid()

    def preexec() -> None:
        prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != parent:  # the parent died before the prctl took effect
            os.kill(os.getpid(), signal.SIGKILL)

    return preexec


def _signal_group(child: Child, sig: signal.Signals) -> None:
    if child.proc is None:
        return
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(child.proc.pid, sig)


def _redis_answers(url: str) -> bool:
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


def _cause(path: Path) -> str | None:
    """The ``error`` of the last error-level JSON line a STAR process logged, if any.

    A process that cannot start logs why in one such line (``startup_failed``),
    the setting to change included.
    """
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return None
    for line in reversed(lines):
        if not line.startswith("{"):
            continue
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        if isinstance(entry, dict) and entry.get("level") in ("error", "critical"):
            return str(entry.get("error") or entry.get("event"))
    return None


def _tail(path: Path, lines: int = 25) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def _health(port: int, api_key: str | None = None) -> dict[str, object] | None:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        request = urllib.request.Request(f"http://127.0.0.1:{port}/health", headers=headers)
        with urllib.request.urlopen(request, timeout=2) as resp:
            return json.loads(resp.read())  # type: ignore[no-any-return]
    except urllib.error.HTTPError as exc:
        with contextlib.suppress(Exception):
            return json.loads(exc.read())  # type: ignore[no-any-return]
        return None
    except (OSError, ValueError):
        return None


async def live_cluster(bus: Bus, fresh_s: float) -> str | None:
    """Who runs a cluster on ``bus`` now (``"scheduler leader X, workers A, B"``), or None.

    A scheduler that holds the leader lock (it lets go when it stops), or a
    worker that reported within ``fresh_s`` and has not announced
    ``worker_down`` since.
    """
    from star.bus import as_str
    from star.wire import Event, EventKind, WireError, decode_as

    leader = await bus.retrying("GET", lambda: bus.redis.get(bus.keys.leader))
    now = time.time()
    reported = {
        r.instance: r.ts for r in (await bus.latest_reports(1000)).values() if now - r.ts <= fresh_s
    }
    for _entry, raw in await bus.since("events", fresh_s):
        try:
            event = decode_as(raw.get(b"body", b""), Event)
        except WireError:
            continue
        gone = event.event == EventKind.WORKER_DOWN
        if gone and event.ts >= reported.get(event.instance, now + 1):
            del reported[event.instance]
    who = [f"scheduler leader {as_str(leader).split('|')[0]}"] if leader else []
    if reported:
        who.append("workers " + ", ".join(sorted(reported)))
    return ", ".join(who) or None


def refuse_a_second_cluster(settings: Settings) -> None:
    """Raise :class:`CliError` if a cluster already runs on ``settings``' Redis and prefix.

    Two ``star up`` on one machine would otherwise share its Redis and the
    default prefix: one bus, each scheduler and proxy steering the other's
    workers.
    """
    from star.bus import Bus

    async def check() -> str | None:
        bus = Bus.from_settings(settings.redis, settings.bus)
        try:
            fresh_s = max(settings.scheduler.staleness_s, 2 * settings.worker.report_interval_s)
            return await live_cluster(bus, fresh_s)
        finally:
            await bus.close()

    if not _redis_answers(settings.redis.url):
        return
    who = asyncio.run(check())
    if who is not None:
        raise CliError(
            f"a cluster is already running on {redact_url(settings.redis.url)} with prefix "
            f"{settings.bus.prefix!r} ({who}); pass --set bus.prefix=NAME to start another "
            "beside it, or stop that one first"
        )


SECRET_ENV = env_key("cluster.secret")


class ClusterError(Exception):
    """A cluster process died or the cluster did not become ready."""


class LocalCluster:
    """Redis (given or private), workers, scheduler and proxy as child process groups.

    The reusable part of ``star up`` (tests use it in process too)::

        with LocalCluster(redis_url, port=0, prefill=1, decode=2) as cluster:
            cluster.wait_ready(300)
            ... cluster.url ...

    ``redis_url=None`` or one where nothing answers starts a private
    ``redis-server``. ``port=0`` picks a free proxy port. ``env`` is the
    children's environment (``STAR_*`` settings included). Each worker's
    OpenMP threads are bound to its own core (round robin) unless the
    environment says otherwise: vLLM binds every engine on a host to the same
    first core(s) by default. :meth:`stop` kills whole process groups, so
    vLLM's engine-core children go too. Unless ``env`` names a
    ``cluster.secret``, the cluster draws its own (:attr:`secret`), so its
    token protocol is authenticated even on loopback.
    """

    def __init__(
        self,
        redis_url: str | None,
        *,
        port: int = 8000,
        prefill: int = 1,
        decode: int = 3,
        model: str | None = None,
        run_dir: Path | None = None,
        env: dict[str, str] | None = None,
        worker_args: list[str] | None = None,
        proxy_args: list[str] | None = None,
        scheduler: bool = True,
    ) -> None:
        if prefill < 1 or decode < 1:
            raise CliError("--prefill and --decode must be at least 1")
        self.requested_redis = redis_url
        self.redis_url = redis_url or ""
        # The proxy's port is bound here and the socket handed to the proxy
        # (``star proxy --fd``): a port merely picked now and bound by the
        # proxy seconds later was once taken in between (star.ports). It stays
        # open here until stop(), so a proxy started again gets the same port.
        try:
            self._proxy_sock: socket.socket | None = listen("127.0.0.1", port)
        except OSError as exc:
            raise CliError(f"proxy port {port} on 127.0.0.1: {exc.strerror}") from exc
        self.port = int(self._proxy_sock.getsockname()[1])
        self.prefill = prefill
        self.decode = decode
        self.model = model
        self.run_dir = Path(run_dir or tempfile.mkdtemp(prefix="star-up-"))
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.env = dict(os.environ if env is None else env)
        self.env.setdefault("STAR_LOG_FORMAT", "json")
        if not self.env.get(SECRET_ENV):
            self.env[SECRET_ENV] = secrets.token_hex(32)
        self.worker_args = list(worker_args or [])
        self.proxy_args = list(proxy_args or [])
        self.scheduler = scheduler
        self.launcher = Launcher(self.run_dir, self.env)
        self.private_redis = False
        # The private redis-server's password (its URL without it below), and
        # the file (mode 0600) another terminal's star commands read it from.
        self.redis_password = ""
        self.redis_password_file = self.run_dir / "redis.password"
        self._previous_sigterm: _SigHandler = None

    @property
    def secret(self) -> str:
        """The cluster secret every child proves on the token protocol."""
        return self.env[SECRET_ENV]

    @property
    def plain_redis_url(self) -> str:
        """:attr:`redis_url` without its password (the private Redis's is in
        :attr:`redis_password`)."""
        return _without_password(self.redis_url)

    def find_hint(self, prefix: str) -> str:
        """What another terminal's ``star`` commands need to find this cluster:
        ``STAR_*=... `` assignments to put before ``star``, no secret in them
        (the private Redis's password is read from :attr:`redis_password_file`)."""
        find = []
        if self.private_redis:
            find.append(f"STAR_REDIS_URL={self.plain_redis_url} ")
            path = shlex.quote(str(self.redis_password_file))
            find.append(f'{env_key("redis.password")}="$(cat {path})" ')
        if prefix != BusSettings().prefix:
            find.append(f"STAR_BUS_PREFIX={prefix} ")
        return redact_url("".join(find))

    @property
    def url(self) -> str:
        """The proxy's base URL."""
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> LocalCluster:
        # A SIGTERM (systemd, ``timeout``, a CI runner) must unwind through
        # ``__exit__`` like Ctrl-C does, or the engines outlive their parent.
        self._previous_sigterm = _on_sigterm_raise()
        try:
            self.start()
        except BaseException:
            self.stop()
            _restore_sigterm(self._previous_sigterm)
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            with contextlib.suppress(KeyboardInterrupt, Terminated):
                self.stop()
        finally:
            _restore_sigterm(self._previous_sigterm)

    def start(self) -> None:
        """Start every process (returns at once; see :meth:`wait_ready`)."""
        if not self.requested_redis or not _redis_answers(self.requested_redis):
            binary = shutil.which("redis-server")
            if binary is None:
                raise CliError(
                    f"no Redis answers at {self.requested_redis} and redis-server is not installed"
                )
            self.private_redis = True
            self.redis_password = secrets.token_urlsafe(32)
            _write_secret(self.redis_password_file, self.redis_password)
            # redis_url carries the password (for callers in this process);
            # the children get it in their environment only, never in argv.
            _, self.redis_url = start_private_redis(
                self.launcher, binary, self.run_dir, 15.0, self.redis_password
            )
            self.env["STAR_REDIS_URL"] = self.plain_redis_url
            self.env[env_key("redis.username")] = ""  # the default user: requirepass
            self.env[env_key("redis.password")] = self.redis_password
        else:
            self.env["STAR_REDIS_URL"] = self.redis_url
        star = [sys.executable, "-m", "star.cli.main"]
        model_args = ["--model", self.model] if self.model else []
        bind = "VLLM_CPU_OMP_THREADS_BIND" not in self.env
        cores = (
            sorted(os.sched_getaffinity(0))
            if hasattr(os, "sched_getaffinity")
            else list(range(os.cpu_count() or 1))
        )
        workers = [("prefill", i) for i in range(self.prefill)] + [
            ("decode", i) for i in range(self.decode)
        ]
        # Each CPU engine gets its share of the cores (OpenMP threads; vLLM's
        # default of every core per engine oversubscribes the host).
        share = max(1, len(cores) // max(len(workers), 1))
        threads = (
            {}
            if {"OMP_NUM_THREADS", "STAR_WORKER_CPU_THREADS"} & set(self.env)
            else {"STAR_WORKER_CPU_THREADS": str(share)}
        )
        for n, (role, i) in enumerate(workers):
            extra = {"VLLM_CPU_OMP_THREADS_BIND": str(cores[n % len(cores)])} if bind else {}
            extra.update(threads)
            self.launcher.start(
                f"{role}-{i}",
                [
                    *star,
                    "worker",
                    "--role",
                    role,
                    "--instance",
                    f"{role}-{i}",
                    *model_args,
                    *self.worker_args,
                ],
                extra,
            )
        if self.scheduler:
            self.launcher.start(
                "scheduler", [*star, "scheduler", "--node", "scheduler-0", "--metrics-port", "0"]
            )
        if self._proxy_sock is None:
            raise CliError("this cluster was stopped")
        fd = self._proxy_sock.fileno()
        self.launcher.start(
            "proxy",
            [*star, "proxy", "--fd", str(fd), *model_args, *self.proxy_args],
            pass_fds=(fd,),
        )

    def check(self) -> None:
        """Raise :class:`ClusterError` if a process has exited."""
        dead = self.launcher.dead()
        if dead is not None:
            status = dead.proc.returncode if dead.proc else "?"
            cause = _cause(dead.log)
            if cause is not None:
                raise ClusterError(
                    f"{dead.name} exited with status {status}: {cause} (log: {dead.log})"
                )
            raise ClusterError(
                f"{dead.name} exited with status {status}; last lines of {dead.log}:\n{_tail(dead.log)}"
            )

    def health(self) -> dict[str, object] | None:
        """The proxy's ``/health`` document, or None while it does not answer."""
        return _health(self.port, self.env.get("STAR_PROXY_API_KEY"))

    def ready(self) -> bool:
        """Every prefill and decode worker is up as the proxy sees it."""
        health = self.health()
        if not health or not health.get("ok"):
            return False
        prefill, decode = health.get("prefill", []), health.get("decode", [])
        assert isinstance(prefill, list) and isinstance(decode, list)
        return len(prefill) >= self.prefill and len(decode) >= self.decode

    def wait_ready(self, timeout_s: float, note: Callable[[float], None] | None = None) -> float:
        """Wait until :meth:`ready`; returns the seconds it took. Raises ClusterError."""
        started = time.monotonic()
        last_note = started
        while not self.ready():
            self.check()
            now = time.monotonic()
            if now - started > timeout_s:
                raise ClusterError(
                    f"not ready after {timeout_s:.0f}s (health: {self.health()}); logs in {self.run_dir}"
                )
            if note is not None and now - last_note > 15:
                last_note = now
                note(now - started)
            time.sleep(0.5)
        return time.monotonic() - started

    def pids(self) -> dict[str, int]:
        """Process id of each child (its process group id too)."""
        return {c.name: c.proc.pid for c in self.launcher.children if c.proc is not None}

    def stop(self, timeout_s: float = 20.0) -> None:
        """Stop everything (SIGTERM, then SIGKILL of whole process groups)."""
        self.launcher.stop(timeout_s)
        if self._proxy_sock is not None:
            self._proxy_sock.close()
            self._proxy_sock = None


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
        raise CliError("the private Redis's password must be printable, without spaces or quotes")
    port = free_port()
    url = f"redis://:{quote(password, safe='')}@127.0.0.1:{port}/0"
    argv = [binary, "-", "--port", str(port), "--bind", "127.0.0.1", "--save", ""]
    argv += ["--appendonly", "no", "--dir", str(run_dir)]
    child = launcher.start("redis", argv, stdin=f"requirepass {password}\n".encode())
    _wait_redis(port, password, launcher, timeout_s)
    return child, url


def _without_password(url: str) -> str:
    """``url`` with no user-info password (the user name stays)."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    user = parts.username or ""
    host = parts.netloc.rpartition("@")[2]
    return urlunsplit(parts._replace(netloc=f"{user}@{host}" if user else host))


def _write_secret(path: Path, value: str) -> None:
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


def _wait_redis(port: int, password: str, launcher: Launcher, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not _private_redis_answers(port, password):
        dead = launcher.dead()
        if dead is not None or time.monotonic() > deadline:
            raise ClusterError(f"private redis-server did not start on 127.0.0.1:{port}")
        time.sleep(0.05)


class Terminated(BaseException):
    """SIGTERM arrived; a BaseException so ``except Exception`` cannot swallow it."""


def _raise_terminated(signum: int, frame: object) -> None:
    raise Terminated(signal.Signals(signum).name)


_SigHandler = Callable[[int, FrameType | None], object] | int | None


def _on_sigterm_raise() -> _SigHandler:
    """Make SIGTERM raise :class:`Terminated` (main thread only; returns the old handler)."""
    if threading.current_thread() is not threading.main_thread():
        return None
    return signal.signal(signal.SIGTERM, _raise_terminated)


def _restore_sigterm(previous: _SigHandler) -> None:
    if previous is not None and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, previous)


def run(args: argparse.Namespace) -> int:
    if args.prefill < 1 or args.decode < 1:
        raise CliError("--prefill and --decode must be at least 1")
    settings = settings_from_args(args, {"proxy.port": args.port, "scheduler.mode": args.mode})
    env = dict(os.environ)
    if getattr(args, "config", None):
        env["STAR_CONFIG"] = str(Path(args.config).resolve())
    for item in args.set_:
        key, _, value = item.partition("=")
        env["STAR_" + key.replace(".", "_").upper()] = value
    if args.mode:
        env["STAR_SCHEDULER_MODE"] = args.mode
    if settings.cluster.secret:  # from a config file too: LocalCluster keeps it
        env[SECRET_ENV] = settings.cluster.secret
    model = args.model or settings.worker.model or None
    refuse_a_second_cluster(settings)
    cluster = LocalCluster(
        settings.redis.url,
        port=settings.proxy.port,
        prefill=args.prefill,
        decode=args.decode,
        model=model,
        run_dir=Path(args.run_dir) if args.run_dir else None,
        env=env,
    )
    port = cluster.port

    previous = _on_sigterm_raise()
    try:
        cluster.start()
        if cluster.private_redis:
            print(
                f"star up: no Redis at {redact_url(settings.redis.url)}; started a private one at "
                f"{cluster.plain_redis_url} (password in {cluster.redis_password_file})"
            )
        print(
            f"star up: starting {args.prefill} prefill + {args.decode} decode workers, scheduler, proxy (logs: {cluster.run_dir})"
        )
        try:
            took = cluster.wait_ready(
                args.ready_timeout,
                lambda s: print(f"star up: waiting for engines to load ({s:.0f}s)...", flush=True),
            )
        except ClusterError as exc:
            print(f"star up: {exc}", file=sys.stderr)
            return 1

        name = "star-tiny" if not model else model
        star = cluster.find_hint(settings.bus.prefix) + "star"
        print(
            f"\nstar up: ready in {took:.0f}s — proxy on http://127.0.0.1:{port}\n\n"
            f"  curl -N http://127.0.0.1:{port}/v1/completions -H 'Content-Type: application/json' \\\n"
            f'       -d \'{{"model": "{name}", "prompt": "give me a long list of animals starting with owl.", "max_tokens": 64, "stream": true}}\'\n\n'
            f"  {star} status                 # instances, load, running requests\n"
            f"  {star} inspect decisions -f   # migrations as they are decided\n\n"
            f"Ctrl-C stops everything.",
            flush=True,
        )
        while True:
            try:
                cluster.check()
            except ClusterError as exc:
                print(f"star up: stopping the cluster: {exc}", file=sys.stderr)
                return 1
            time.sleep(0.5)
    except (KeyboardInterrupt, Terminated):
        print("\nstar up: stopping...", flush=True)
        return 0
    finally:
        _restore_sigterm(previous)
        with contextlib.suppress(KeyboardInterrupt, Terminated):
            cluster.stop()
        print(f"star up: stopped (logs kept in {cluster.run_dir})", flush=True)
