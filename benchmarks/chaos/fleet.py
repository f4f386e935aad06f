"""A STAR fleet spread over simulated hosts (:mod:`benchmarks.chaos.netns`).

Each process runs in its own namespace and is configured the way an
operator configures separate hosts: Redis binds its host's address and
wants a password, every worker binds and advertises its host's address
(token protocol and NIXL's side channel), the proxy listens on its host's
address, and the cluster secret authenticates the token protocol (required
beyond loopback). UCX is held to TCP (``UCX_TLS=tcp``), so KV pulls cross
the links too (namespaces share memory, and UCX would otherwise move the
blocks through shared memory, past every network fault).

Hosts: ``redis``, ``sched0``, ``sched1`` (two schedulers, one leader),
``proxy`` and ``proxy1``.. (the proxies ``proxy``, ``proxy-1``..: clients
spread over them, as behind a load balancer), ``p0`` (prefill-0), ``d0``..
(decode-0..). With ``sentinel``, Redis is replicated and watched the way an
operator runs it highly available: ``redis-1`` (host ``redis1``) replicates
``redis``, three Sentinels (``sentinel-0..2`` on ``redis``, ``redis1`` and
``sched0``, quorum 2) watch them, and every STAR process finds the master
through them (``redis.sentinels``). Every process can be
SIGKILLed (:meth:`NetFleet.kill`) and started again with the same argv and
address (:meth:`NetFleet.restart`), as systemd's ``Restart=always`` would.
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import shutil
import signal
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

from benchmarks.chaos.netns import Network
from star.fleet import Child, Launcher, group_members
from star.settings import RedisSettings, env_key

SECRET_ENV = env_key("cluster.secret")
MODEL = "star-tiny"
WORKER_PORT = 7100
PROXY_PORT = 8000
REDIS_PORT = 6379
SENTINEL_PORT = 26379
SERVICE = "star-chaos"  # the master's name in the Sentinels' configuration
SENTINEL_HOSTS = ("redis", "redis1", "sched0")


def host_names(
    decode: int, schedulers: int = 2, proxies: int = 1, sentinel: bool = False
) -> list[str]:
    """The namespaces a fleet of ``decode`` decode workers needs."""
    return [
        "redis",
        *(["redis1"] if sentinel else []),
        *(f"sched{i}" for i in range(schedulers)),
        "proxy",
        *(f"proxy{i}" for i in range(1, proxies)),
        "p0",
        *(f"d{i}" for i in range(decode)),
    ]


class NetFleet:
    """Redis, schedulers, proxy and workers, each on its own host of ``net``.

    ``persist`` runs Redis with its append-only file (``appendfsync always``),
    so a killed Redis comes back with the streams and the leader lock.
    ``env`` is the base environment of every process (``STAR_*`` settings).
    """

    def __init__(
        self,
        net: Network,
        run_dir: Path,
        *,
        decode: int = 2,
        schedulers: int = 2,
        proxies: int = 1,
        env: dict[str, str] | None = None,
        worker_args: list[str] | None = None,
        persist: bool = False,
        sentinel: bool = False,
    ) -> None:
        self.net = net
        self.run_dir = run_dir
        self.decode = decode
        self.schedulers = schedulers
        self.proxy_names = ["proxy", *(f"proxy-{i}" for i in range(1, proxies))]
        self.persist = persist
        self.sentinel = sentinel
        self.password = secrets.token_hex(16)
        base = dict(os.environ if env is None else env)
        base.pop("STAR_CONFIG", None)
        base.setdefault(SECRET_ENV, secrets.token_hex(32))
        base.setdefault("STAR_LOG_FORMAT", "json")
        base["STAR_REDIS_URL"] = self.redis_url
        if sentinel:
            base["STAR_REDIS_SENTINELS"] = ",".join(self.sentinel_addresses)
            base["STAR_REDIS_SERVICE_NAME"] = SERVICE
        base["UCX_TLS"] = "tcp"
        base["UCX_NET_DEVICES"] = "eth0"
        self.env = base
        self.worker_args = list(worker_args or [])
        self.launcher = Launcher(run_dir, base)
        self._argv: dict[str, tuple[list[str], dict[str, str]]] = {}

    # -- addresses ------------------------------------------------------------

    def ip(self, host: str) -> str:
        return self.net.hosts[host].ip

    @property
    def redis_url(self) -> str:
        return f"redis://:{self.password}@{self.ip('redis')}:{REDIS_PORT}/0"

    @property
    def sentinel_addresses(self) -> list[str]:
        return [f"{self.ip(host)}:{SENTINEL_PORT}" for host in SENTINEL_HOSTS]

    @property
    def secret(self) -> str:
        """The cluster secret every process signs the bus with."""
        return self.env[SECRET_ENV]

    def redis_settings(self) -> RedisSettings:
        """How to reach this fleet's bus (through the Sentinels with ``sentinel``)."""
        if not self.sentinel:
            return RedisSettings(url=self.redis_url)
        return RedisSettings(
            url=self.redis_url, sentinels=tuple(self.sentinel_addresses), service_name=SERVICE
        )

    @property
    def url(self) -> str:
        """The first proxy's base URL (reachable from the root namespace)."""
        return self.urls[0]

    @property
    def urls(self) -> list[str]:
        """Every proxy's base URL, the first proxy's first."""
        return [self.url_of(name) for name in self.proxy_names]

    def url_of(self, proxy: str) -> str:
        return f"http://{self.ip(self.host_of(proxy))}:{PROXY_PORT}"

    @property
    def decode_names(self) -> list[str]:
        return [f"decode-{i}" for i in range(self.decode)]

    @property
    def argv_names(self) -> list[str]:
        """Every process this fleet started (by name)."""
        return list(self._argv)

    @property
    def worker_names(self) -> list[str]:
        return ["prefill-0", *self.decode_names]

    def host_of(self, name: str) -> str:
        """The host a process runs on (``decode-1`` → ``d1``)."""
        if name.startswith(("decode-", "prefill-")):
            return name[0] + name.split("-")[1]
        if name.startswith("scheduler-"):
            return "sched" + name.split("-")[1]
        if name.startswith(("proxy-", "redis-")):
            return name.replace("-", "")
        if name.startswith("sentinel-"):
            return SENTINEL_HOSTS[int(name.split("-")[1])]
        return name

    # -- processes ------------------------------------------------------------

    def start(self) -> None:
        """Start every process (returns at once; see :meth:`wait_ready`)."""
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("redis-server is not installed")
        data = self.run_dir / "redis"
        data.mkdir(exist_ok=True)
        self._spawn(
            "redis",
            [
                binary, "--bind", self.ip("redis"), "--port", str(REDIS_PORT),
                "--requirepass", self.password, "--save", "",
                "--appendonly", "yes" if self.persist else "no", "--appendfsync", "always",
                "--dir", str(data), "--protected-mode", "no",
            ],
        )  # fmt: skip
        self._wait_redis(30)
        if self.sentinel:
            self._start_sentinels(binary)
        star = [sys.executable, "-m", "star.cli.main"]
        workers = [("prefill", 0)] + [("decode", i) for i in range(self.decode)]
        for n, (role, i) in enumerate(workers):
            name = f"{role}-{i}"
            host = self.host_of(name)
            cpus = sorted(os.sched_getaffinity(0))
            self._spawn(
                name,
                [
                    *star, "worker", "--role", role, "--instance", name,
                    "--host", self.ip(host), "--port", str(WORKER_PORT), *self.worker_args,
                ],
                {"VLLM_CPU_OMP_THREADS_BIND": str(cpus[n % len(cpus)]),
                 "STAR_WORKER_CPU_THREADS": "1"},
            )  # fmt: skip
        for i in range(self.schedulers):
            self._spawn(
                f"scheduler-{i}",
                [*star, "scheduler", "--node", f"scheduler-{i}", "--metrics-port", "0"],
            )
        for name in self.proxy_names:
            self._spawn(
                name,
                [
                    *star, "proxy", "--host", self.ip(self.host_of(name)), "--port",
                    str(PROXY_PORT), "--served-model-name", MODEL,
                ],
            )  # fmt: skip

    def _start_sentinels(self, binary: str) -> None:
        """The replica ``redis-1`` and three Sentinels (quorum 2, down after 1 s)."""
        data = self.run_dir / "redis-1"
        data.mkdir(exist_ok=True)
        self._spawn(
            "redis-1",
            [
                binary, "--bind", self.ip("redis1"), "--port", str(REDIS_PORT),
                "--requirepass", self.password, "--masterauth", self.password,
                "--replicaof", self.ip("redis"), str(REDIS_PORT), "--save", "",
                "--appendonly", "no", "--dir", str(data), "--protected-mode", "no",
                "--repl-diskless-sync-delay", "0",
            ],
        )  # fmt: skip
        self._wait_redis(30, "redis1")
        for i, host in enumerate(SENTINEL_HOSTS):
            name = f"sentinel-{i}"
            home = self.run_dir / name
            home.mkdir(exist_ok=True)
            conf = home / "sentinel.conf"  # a Sentinel rewrites its own file
            conf.write_text(
                f"bind {self.ip(host)}\nport {SENTINEL_PORT}\ndir {home}\nprotected-mode no\n"
                f"sentinel monitor {SERVICE} {self.ip('redis')} {REDIS_PORT} 2\n"
                f"sentinel auth-pass {SERVICE} {self.password}\n"
                f"sentinel down-after-milliseconds {SERVICE} 1000\n"
                f"sentinel failover-timeout {SERVICE} 10000\n"
                f"sentinel known-replica {SERVICE} {self.ip('redis1')} {REDIS_PORT}\n"
            )
            self._spawn(name, [binary, str(conf), "--sentinel"])

    def master(self) -> str:
        """The host the Sentinels name as master now ('' if they do not answer)."""
        import redis

        for address in self.sentinel_addresses:
            host, port = address.split(":")
            client = redis.Redis(host=host, port=int(port), socket_timeout=1, decode_responses=True)
            try:
                answer = client.execute_command(  # type: ignore[no-untyped-call]
                    "SENTINEL", "get-master-addr-by-name", SERVICE
                )
            except redis.RedisError:
                continue
            finally:
                client.close()
            if not answer:
                continue
            ip = str(answer[0])
            return next((h for h, n in self.net.hosts.items() if n.ip == ip), ip)
        return ""

    def _spawn(self, name: str, argv: list[str], extra: dict[str, str] | None = None) -> Child:
        self._argv[name] = (argv, dict(extra or {}))
        return self.launcher.start(name, self.net.argv(self.host_of(name), argv), extra)

    def restart(self, name: str) -> None:
        """Start ``name`` again with its argv (after :meth:`kill`); its last log is kept."""
        log = self.log(name)
        lives = sum(1 for c in self.launcher.children if c.name == name)
        if log.exists():
            log.rename(log.with_suffix(f".{lives}.log"))
        argv, extra = self._argv[name]
        self._spawn(name, argv, extra)
        if name in ("redis", "redis-1"):
            self._wait_redis(30, self.host_of(name))

    async def persistence(self, on: bool) -> None:
        """Turn Redis' append-only file on (or off) now and for every restart."""
        import redis.asyncio as aioredis

        client = aioredis.Redis.from_url(self.redis_url, socket_timeout=5)
        try:
            await client.config_set("appendfsync", "always")
            await client.config_set("appendonly", "yes" if on else "no")
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:  # the first rewrite writes the file
                info = await client.info("persistence")
                if int(info.get("aof_enabled", 0)) == on and not int(
                    info.get("aof_rewrite_in_progress", 0)
                ):
                    break
                await asyncio.sleep(0.1)
        finally:
            await client.aclose()
        argv = self._argv["redis"][0]
        at = argv.index("--appendonly")
        argv[at + 1] = "yes" if on else "no"
        self.persist = on

    def _latest(self, name: str) -> Child | None:
        """The latest process started as ``name`` (earlier ones were killed)."""
        for child in reversed(self.launcher.children):
            if child.name == name and child.proc is not None:
                return child
        return None

    def pid(self, name: str) -> int:
        """The latest process started as ``name``."""
        child = self._latest(name)
        if child is None or child.proc is None:
            raise KeyError(name)
        return child.proc.pid

    def alive(self, name: str) -> bool:
        child = self._latest(name)
        return child is not None and child.proc is not None and child.proc.poll() is None

    def kill(self, name: str) -> None:
        """SIGKILL ``name``'s whole process group (vLLM's engine processes too)."""
        pid = self.pid(name)
        try:
            os.killpg(pid, signal.SIGKILL)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + 30
        while group_members({pid}) and time.monotonic() < deadline:
            time.sleep(0.05)
        for child in self.launcher.children:
            if child.name == name and child.proc is not None:
                child.proc.poll()

    def terminate(self, name: str, timeout_s: float) -> float | None:
        """SIGTERM ``name``'s process group, as ``systemctl stop`` (or a rolling restart) does.

        Returns how long the group took to exit, or None if it was still there
        after ``timeout_s`` (then it is SIGKILLed, as systemd's
        ``TimeoutStopSec`` would).
        """
        pid = self.pid(name)
        started = time.monotonic()
        try:
            os.killpg(pid, signal.SIGTERM)
        except ProcessLookupError:
            return 0.0
        while group_members({pid}):
            if time.monotonic() - started > timeout_s:
                self.kill(name)
                return None
            time.sleep(0.05)
        took = time.monotonic() - started
        for child in self.launcher.children:
            if child.name == name and child.proc is not None:
                child.proc.poll()
        return took

    def stop(self, timeout_s: float = 20.0) -> None:
        self.launcher.stop(timeout_s)

    def leftovers(self) -> list[tuple[int, int, str]]:
        """Processes of any group this fleet started that are still there."""
        return group_members({c.proc.pid for c in self.launcher.children if c.proc is not None})

    def log(self, name: str) -> Path:
        return self.run_dir / f"{name}.log"

    # -- readiness ------------------------------------------------------------

    def health(self, url: str | None = None) -> dict[str, Any] | None:
        """``/health`` of the proxy at ``url`` (default: the first)."""
        try:
            with urllib.request.urlopen((url or self.url) + "/health", timeout=2) as resp:
                doc = json.loads(resp.read())
                return doc if isinstance(doc, dict) else None
        except (OSError, ValueError):
            return None

    def ready(self) -> bool:
        """Every proxy sees the prefill worker and every decode worker."""
        for url in self.urls:
            health = self.health(url)
            if not health or not health.get("ok"):
                return False
            if len(health.get("prefill", [])) < 1 or len(health.get("decode", [])) < self.decode:
                return False
        return True

    def wait_ready(self, timeout_s: float) -> float:
        """Wait until the proxy sees every worker; raise (naming a dead process) if not."""
        started = time.monotonic()
        while not self.ready():
            # Killed incarnations stay among the launcher's children: only a
            # name's latest process counts.
            dead = [name for name in self._argv if not self.alive(name)]
            if dead:
                raise RuntimeError(f"{dead[0]} exited; see {self.log(dead[0])}")
            if time.monotonic() - started > timeout_s:
                raise RuntimeError(
                    f"fleet not ready after {timeout_s:.0f} s (health {self.health()}); logs in {self.run_dir}"
                )
            time.sleep(0.5)
        return time.monotonic() - started

    def _wait_redis(self, timeout_s: float, host: str = "redis") -> None:
        import redis

        client = redis.Redis(
            host=self.ip(host), port=REDIS_PORT, password=self.password, socket_timeout=1
        )
        deadline = time.monotonic() + timeout_s
        try:
            while True:
                try:
                    if client.ping():
                        return
                except redis.RedisError:
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError(f"redis did not answer within {timeout_s:.0f} s")
                time.sleep(0.1)
        finally:
            client.close()
