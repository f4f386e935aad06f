"""A whole local cluster as child process groups (the code path of ``star up``).

Redis at the given URL or, if none answers, a private ``redis-server`` (or
the master that given Sentinels name, followed across failovers); prefill and decode workers; the scheduler; the proxy on a port bound here
and handed over. Every process runs in its own session (:mod:`star.fleet.processes`),
so stopping kills whole process groups. A process that dies is reported by
its one-line cause; :meth:`LocalCluster.wait_ready` waits for the proxy to
see every worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import secrets
import shlex
import shutil
import socket
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from star.fleet.errors import ClusterError, FleetError
from star.fleet.private_redis import (
    redis_answers,
    sentinel_master_problem,
    start_private_redis,
    without_password,
    write_secret,
)
from star.fleet.processes import (
    Child,
    Launcher,
    SigHandler,
    Terminated,
    on_sigterm_raise,
    restore_sigterm,
)
from star.ports import listen
from star.redact import redact_url
from star.redis_sentinel import describe
from star.settings import BusSettings, RedisSettings, Settings, env_key

if TYPE_CHECKING:
    from star.bus import Bus


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
    for _entry, raw in bus.signed("events", await bus.since("events", fresh_s)):
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
    """Raise :class:`FleetError` if a cluster already runs on ``settings``' Redis and prefix.

    Two ``star up`` on one machine would otherwise share its Redis and the
    default prefix: one bus, each scheduler and proxy steering the other's
    workers.
    """
    from star.bus import Bus

    async def check() -> str | None:
        bus = Bus.for_cluster(settings, "operator")
        try:
            fresh_s = max(settings.scheduler.staleness_s, 2 * settings.worker.report_interval_s)
            return await live_cluster(bus, fresh_s)
        finally:
            await bus.close()

    if settings.redis.sentinels:
        problem = sentinel_master_problem(settings.redis)
        if problem is not None:
            raise FleetError(
                f"no Redis answers as {describe(settings.redis)}: {problem} (start the "
                "Sentinels and their master, or unset redis.sentinels for a private Redis)"
            )
    elif not redis_answers(settings.redis.url):
        return
    who = asyncio.run(check())
    if who is not None:
        raise FleetError(
            f"a cluster is already running on {describe(settings.redis)} with prefix "
            f"{settings.bus.prefix!r} ({who}); pass --set bus.prefix=NAME to start another "
            "beside it, or stop that one first"
        )


SECRET_ENV = env_key("cluster.secret")

# A proxy that dies unexpectedly is started again after each of these pauses
# in turn (``restart_proxy``); one more death within PROXY_STABLE_S of its
# last start stops the cluster. A proxy that ran that long starts afresh.
PROXY_RESTART_DELAYS_S = (0.5, 1.0, 2.0, 4.0, 8.0)
PROXY_STABLE_S = 60.0


def _startup_failed(path: Path) -> bool:
    """The process logged that it could not start (a setting, a port): no restart helps."""
    try:
        return '"startup_failed"' in path.read_text(errors="replace")
    except OSError:
        return False


class LocalCluster:
    """Redis (given or private), workers, scheduler and proxy as child process groups.

    The reusable part of ``star up`` (tests use it in process too)::

        with LocalCluster(redis_url, port=0, prefill=1, decode=2) as cluster:
            cluster.wait_ready(300)
            ... cluster.url ...

    ``redis_url=None`` or one where nothing answers starts a private
    ``redis-server``. With ``sentinels`` (``redis.sentinels`` entries) every
    child reaches the master those Sentinels name for ``service_name`` and
    follows it across a failover; ``redis_url`` then gives only the master's
    scheme, database and credentials, and no private Redis is started.
    ``port=0`` picks a free proxy port. ``env`` is the
    children's environment (``STAR_*`` settings included). Each worker's
    OpenMP threads are bound to its own core (round robin) unless the
    environment says otherwise: vLLM binds every engine on a host to the same
    first core(s) by default. :meth:`stop` kills whole process groups, so
    vLLM's engine-core children go too. Unless ``env`` names a
    ``cluster.secret``, the cluster draws its own (:attr:`secret`), so its
    token protocol is authenticated even on loopback.

    With ``restart_proxy`` (``star up``), a proxy that dies while the cluster
    runs (SIGKILL, a crash, an OOM kill) is started again on the same socket,
    as systemd's ``Restart=always`` would: at most
    ``len(PROXY_RESTART_DELAYS_S)`` times in a row, after those pauses, each
    one told to ``notify``; the log of the one that died is kept as
    ``proxy.N.log``. Clients meanwhile wait in the socket's backlog, and a
    cut stream resumes on the new proxy (the decode workers hold its requests,
    ``worker.orphan_grace_s``). A proxy that could not start
    (``startup_failed``), or any other process that exits, stops the cluster
    through :meth:`check`; :meth:`stop` restarts nothing.
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
        restart_proxy: bool = False,
        notify: Callable[[str], None] | None = None,
        sentinels: Sequence[str] = (),
        service_name: str = RedisSettings().service_name,
    ) -> None:
        if prefill < 1 or decode < 1:
            raise FleetError("--prefill and --decode must be at least 1")
        self.requested_redis = redis_url
        self.redis_url = redis_url or ""
        self.sentinels = tuple(sentinels)
        self.service_name = service_name
        # The proxy's port is bound here and the socket handed to the proxy
        # (``star proxy --fd``): a port merely picked now and bound by the
        # proxy seconds later was once taken in between (star.ports). It stays
        # open here until stop(), so a proxy started again gets the same port.
        try:
            self._proxy_sock: socket.socket | None = listen("127.0.0.1", port)
        except OSError as exc:
            raise FleetError(f"proxy port {port} on 127.0.0.1: {exc.strerror}") from exc
        self.port = int(self._proxy_sock.getsockname()[1])
        self.prefill = prefill
        self.decode = decode
        self.model = model
        self.run_dir = Path(run_dir or tempfile.mkdtemp(prefix="star-up-"))
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.env = dict(os.environ if env is None else env)
        self.env.setdefault("STAR_LOG_FORMAT", "json")
        # A secret drawn here is also in a file (mode 0600) for another
        # terminal's star commands: `star migrate` must sign its decisions.
        self.secret_file: Path | None = None
        if not self.env.get(SECRET_ENV):
            self.env[SECRET_ENV] = secrets.token_hex(32)
            self.secret_file = self.run_dir / "cluster.secret"
            write_secret(self.secret_file, self.env[SECRET_ENV])
        self.worker_args = list(worker_args or [])
        self.proxy_args = list(proxy_args or [])
        self.scheduler = scheduler
        self.launcher = Launcher(self.run_dir, self.env)
        self.private_redis = False
        # The private redis-server's password (its URL without it below), and
        # the file (mode 0600) another terminal's star commands read it from.
        self.redis_password = ""
        self.redis_password_file = self.run_dir / "redis.password"
        self._previous_sigterm: SigHandler = None
        self.restart_proxy = restart_proxy
        self.notify = notify or (lambda message: None)
        self.proxy_restarts = 0  # in a row (reset once a proxy ran PROXY_STABLE_S)
        self._proxy_started_at = 0.0
        self._proxy_died_at: float | None = None
        self._proxy_logs = 0  # proxy.N.log kept so far
        self._stopping = False

    @property
    def secret(self) -> str:
        """The cluster secret every child proves on the token protocol."""
        return self.env[SECRET_ENV]

    @property
    def plain_redis_url(self) -> str:
        """:attr:`redis_url` without its password (the private Redis's is in
        :attr:`redis_password`)."""
        return without_password(self.redis_url)

    def find_hint(self, prefix: str) -> str:
        """What another terminal's ``star`` commands need to find this cluster:
        ``STAR_*=... `` assignments to put before ``star``, no secret in them
        (the private Redis's password is read from :attr:`redis_password_file`,
        a drawn cluster secret from :attr:`secret_file`)."""
        find = []
        if self.sentinels:
            find.append(f"{env_key('redis.sentinels')}={shlex.quote(','.join(self.sentinels))} ")
            if self.service_name != RedisSettings().service_name:
                find.append(f"{env_key('redis.service_name')}={shlex.quote(self.service_name)} ")
        if self.private_redis:
            find.append(f"STAR_REDIS_URL={self.plain_redis_url} ")
            path = shlex.quote(str(self.redis_password_file))
            find.append(f'{env_key("redis.password")}="$(cat {path})" ')
        if self.secret_file is not None:
            path = shlex.quote(str(self.secret_file))
            find.append(f'{SECRET_ENV}="$(cat {path})" ')
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
        self._previous_sigterm = on_sigterm_raise()
        try:
            self.start()
        except BaseException:
            self.stop()
            restore_sigterm(self._previous_sigterm)
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            with contextlib.suppress(KeyboardInterrupt, Terminated):
                self.stop()
        finally:
            restore_sigterm(self._previous_sigterm)

    def start(self) -> None:
        """Start every process (returns at once; see :meth:`wait_ready`)."""
        if self.sentinels:
            self.env[env_key("redis.sentinels")] = ",".join(self.sentinels)
            self.env[env_key("redis.service_name")] = self.service_name
            if self.requested_redis:
                self.env["STAR_REDIS_URL"] = self.redis_url
        elif not self.requested_redis or not redis_answers(self.requested_redis):
            binary = shutil.which("redis-server")
            if binary is None:
                raise FleetError(
                    f"no Redis answers at {self.requested_redis} and redis-server is not installed"
                )
            self.private_redis = True
            self.redis_password = secrets.token_urlsafe(32)
            write_secret(self.redis_password_file, self.redis_password)
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
            raise FleetError("this cluster was stopped")
        fd = self._proxy_sock.fileno()
        self._proxy_started_at = time.monotonic()
        self.launcher.start(
            "proxy",
            [*star, "proxy", "--fd", str(fd), *model_args, *self.proxy_args],
            pass_fds=(fd,),
        )

    def check(self) -> None:
        """Raise :class:`ClusterError` if a process has exited (a proxy with
        ``restart_proxy``: once it is not to be started again)."""
        for dead in [c for c in self.launcher.children if c.proc and c.proc.poll() is not None]:
            if dead.name == "proxy" and self._restarting_proxy(dead):
                continue
            status = dead.proc.returncode if dead.proc else "?"
            cause = _cause(dead.log)
            if cause is not None:
                raise ClusterError(
                    f"{dead.name} exited with status {status}: {cause} (log: {dead.log})"
                )
            raise ClusterError(
                f"{dead.name} exited with status {status}; last lines of {dead.log}:\n{_tail(dead.log)}"
            )

    def _restarting_proxy(self, dead: Child) -> bool:
        """Whether the dead proxy is (being) started again; starts it once its pause is over."""
        if not self.restart_proxy or self._stopping or self._proxy_sock is None:
            return False
        if _startup_failed(dead.log):
            return False
        now = time.monotonic()
        if self._proxy_died_at is None:
            if now - self._proxy_started_at >= PROXY_STABLE_S:
                self.proxy_restarts = 0
            if self.proxy_restarts >= len(PROXY_RESTART_DELAYS_S):
                self.notify(
                    f"the proxy died {self.proxy_restarts + 1} times in a row; not starting it again"
                )
                return False
            self._proxy_died_at = now
            status = dead.proc.returncode if dead.proc else "?"
            self.notify(
                f"the proxy exited with status {status}; starting it again in "
                f"{PROXY_RESTART_DELAYS_S[self.proxy_restarts]:g} s (restart "
                f"{self.proxy_restarts + 1} of {len(PROXY_RESTART_DELAYS_S)} in a row)"
            )
            return True
        if now - self._proxy_died_at < PROXY_RESTART_DELAYS_S[self.proxy_restarts]:
            return True
        self.proxy_restarts += 1
        self._proxy_logs += 1
        old_log = self.run_dir / f"proxy.{self._proxy_logs}.log"
        again = self.launcher.restart(dead, old_log)
        self._proxy_started_at, self._proxy_died_at = time.monotonic(), None
        pid = again.proc.pid if again.proc else "?"
        self.notify(f"proxy started again (pid {pid}; the log of the one that died: {old_log})")
        return True

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
        self._stopping = True
        self.launcher.stop(timeout_s)
        if self._proxy_sock is not None:
            self._proxy_sock.close()
            self._proxy_sock = None
