"""A replicated Redis under Sentinel for tests: a master, its replicas and
Sentinels, each a ``redis-server`` process (``--replicaof``, ``--sentinel``
with a ``sentinel.conf`` it may rewrite) on free ports under one directory."""

from __future__ import annotations

import socket
import subprocess
import time
from pathlib import Path

import redis

from star.ports import free_port
from tests.redis_server import RedisServer, launch, terminate

SERVICE = "star-test"


def _answers(port: int) -> bool:
    with socket.create_connection(("127.0.0.1", port), timeout=0.2) as sock:
        sock.sendall(b"PING\r\n")
        return sock.recv(64).startswith((b"+PONG", b"-NOAUTH"))  # up, maybe with a password


class Node:
    """One redis-server process (a data node or a Sentinel)."""

    def __init__(self, root: Path, name: str, password: str = "") -> None:
        self.password = password
        self.dir = root / name
        self.dir.mkdir(parents=True)
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def log(self) -> Path:
        return self.dir / "redis.log"

    def start(self, args: list[str]) -> None:
        self.proc = launch(args, self.log, lambda: _answers(self.port))

    def client(self) -> redis.Redis:
        return redis.Redis(port=self.port, socket_timeout=5, password=self.password or None)

    def stop(self) -> None:
        if self.proc is not None:
            if self.proc.poll() is None:
                terminate(self.proc)
            self.proc = None


class SentinelSet:
    """``replicas`` replicas of one master, watched by ``sentinels`` Sentinels
    (quorum 1, down-after 1 s). ``data_args`` go to every data node
    (e.g. ``--min-replicas-to-write 1``); ``password`` is the data nodes'
    ``requirepass`` (and ``masterauth``), ``sentinel_password`` the Sentinels'."""

    def __init__(
        self,
        root: Path,
        replicas: int = 1,
        sentinels: int = 1,
        data_args: tuple[str, ...] = (),
        password: str = "",
        sentinel_password: str = "",
    ) -> None:
        self.binary = RedisServer(root).binary
        self.data = [Node(root, "master", password)] + [
            Node(root, f"replica{i}", password) for i in range(replicas)
        ]
        self.sentinels = [Node(root, f"sentinel{i}", sentinel_password) for i in range(sentinels)]
        self.data_args = data_args
        self.password = password
        self.sentinel_password = sentinel_password

    def start(self) -> None:
        master = self.data[0]
        for node in self.data:
            args = [
                self.binary,
                "--port", str(node.port),
                "--bind", "127.0.0.1",
                "--dir", str(node.dir),
                "--save", "",
                "--appendonly", "no",
                "--daemonize", "no",
                "--logfile", str(node.log),
                "--repl-diskless-sync-delay", "0",  # a replica syncs at once, not after 5 s
                *self.data_args,
            ]  # fmt: skip
            if self.password:
                args += ["--requirepass", self.password, "--masterauth", self.password]
            if node is not master:
                args += ["--replicaof", "127.0.0.1", str(master.port)]
            node.start(args)
        for node in self.sentinels:
            conf = node.dir / "sentinel.conf"  # Sentinel rewrites it: its own file
            conf.write_text(
                f"port {node.port}\n"
                "bind 127.0.0.1\n"
                f"dir {node.dir}\n"
                f"logfile {node.log}\n"
                f"sentinel monitor {SERVICE} 127.0.0.1 {master.port} 1\n"
                f"sentinel down-after-milliseconds {SERVICE} 1000\n"
                f"sentinel failover-timeout {SERVICE} 10000\n"
                + (f"sentinel auth-pass {SERVICE} {self.password}\n" if self.password else "")
                + (f"requirepass {self.sentinel_password}\n" if self.sentinel_password else "")
                # Known at once, not after the master's next INFO (up to 10 s).
                + "".join(
                    f"sentinel known-replica {SERVICE} 127.0.0.1 {n.port}\n"
                    for n in self.data
                    if n is not master
                )
            )
            node.start([self.binary, str(conf), "--sentinel"])
        self.wait_synced()

    def stop(self) -> None:
        for node in self.sentinels + self.data:
            node.stop()

    @property
    def addresses(self) -> tuple[str, ...]:
        """``redis.sentinels``: every Sentinel as host:port."""
        return tuple(f"127.0.0.1:{node.port}" for node in self.sentinels)

    def master(self) -> Node:
        """The data node the (first) Sentinel names as master now."""
        with self.sentinels[0].client() as client:
            _host, port = client.sentinel_get_master_addr_by_name(SERVICE)
        return next(node for node in self.data if node.port == int(port))

    def wait_synced(self, within_s: float = 30.0) -> None:
        """Until every replica's link is up and every Sentinel knows every replica."""
        deadline = time.monotonic() + within_s
        while True:
            try:
                if self._synced():
                    return
            except (redis.RedisError, OSError):
                pass
            if time.monotonic() > deadline:
                raise AssertionError("the replicas or Sentinels did not settle")
            time.sleep(0.05)

    def _synced(self) -> bool:
        master = self.master()
        # A replica that finished its sync still gets nothing until its first
        # REPLCONF ACK (up to a second later): wait until every one acknowledges.
        with master.client() as client:
            client.incr("sentinel-set:probe")
            if client.wait(len(self.data) - 1, 200) < len(self.data) - 1:
                return False
        for node in self.data:
            if node is master:
                continue
            with node.client() as client:
                info = client.info("replication")
            if info.get("master_link_status") != "up" or info.get("master_port") != master.port:
                return False
        for node in self.sentinels:
            with node.client() as client:
                known = client.sentinel_slaves(SERVICE)
            ports = {
                int(r["port"]) for r in known if not r["is_sdown"] and not r["is_disconnected"]
            }
            if len(ports & {n.port for n in self.data if n is not master}) < len(self.data) - 1:
                return False
        return True

    def kill_master(self, within_s: float = 30.0) -> Node:
        """SIGKILL the master; returns the replica the Sentinel promotes (after
        down-after-milliseconds, 1 s, and the failover)."""
        old = self.master()
        assert old.proc is not None
        old.proc.kill()
        old.proc.wait()
        old.proc = None
        deadline = time.monotonic() + within_s
        while (new := self.master()) is old:
            if time.monotonic() > deadline:
                raise AssertionError("the Sentinel did not promote a replica")
            time.sleep(0.05)
        return new

    def failover(self, within_s: float = 30.0) -> Node:
        """``SENTINEL FAILOVER``; returns the promoted node once the Sentinel names it."""
        old = self.master()
        deadline = time.monotonic() + within_s
        while True:
            try:
                with self.sentinels[0].client() as client:
                    client.execute_command("SENTINEL FAILOVER", SERVICE)
                break
            except redis.ResponseError as exc:  # NOGOODSLAVE: not yet sure of a replica
                if time.monotonic() > deadline:
                    raise AssertionError(f"SENTINEL FAILOVER refused: {exc}") from exc
                time.sleep(0.1)
        while (new := self.master()) is old:
            if time.monotonic() > deadline:
                raise AssertionError("the Sentinel did not switch to a new master")
            time.sleep(0.02)
        return new
