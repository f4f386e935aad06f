"""Least privilege on Redis (issue 27 item 2): ``star config acl``'s users, one per
role, loaded into a real ``redis-server`` (``--aclfile``), each role's own code
path working with its user and the refusals that keep a role in its lane."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import redis.asyncio as aioredis
from redis.exceptions import AuthenticationError, NoPermissionError

from proxy.cluster import Directory
from scheduler.leader import Leadership
from star.bus import Bus, BusUnavailable, GroupReader, Subscriber
from star.bus.acl import ROLES, RoleUser, acl_file, role_users
from star.cli.main import main
from star.ports import free_port
from star.settings import BusSettings, RedisSettings
from star.wire import Decision, Event, EventKind, LoadEntry, Report
from tests.redis_server import launch, terminate
from tests.scheduler.reports import report as heavy_report

PREFIX = f"acl{uuid.uuid4().hex[:6]}"


class AclRedis:
    """``redis-server --aclfile`` with the users ``star config acl`` made for PREFIX."""

    def __init__(self, workdir: Path, users: list[RoleUser]) -> None:
        self.dir = workdir
        self.port = free_port()
        self.users = {u.role: u for u in users}
        self.aclfile = workdir / "users.acl"
        self.aclfile.write_text(acl_file(users))
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        import shutil

        binary = shutil.which("redis-server")
        if binary is None:
            pytest.skip("redis-server is not installed")
        args = [
            binary,
            "--port", str(self.port),
            "--bind", "127.0.0.1",
            "--aclfile", str(self.aclfile),
            "--dir", str(self.dir),
            "--save", "",
            "--appendonly", "no",
            "--daemonize", "no",
            "--logfile", str(self.dir / "redis.log"),
        ]  # fmt: skip
        self.proc = launch(args, self.dir / "redis.log", self._answers)

    def _answers(self) -> bool:
        op = self.users["operator"]
        with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as sock:
            sock.sendall(f"AUTH {op.name} {op.password}\r\nPING\r\n".encode())
            time.sleep(0.05)
            return b"+PONG" in sock.recv(256)

    def settings(self, role: str | None, **kw: object) -> RedisSettings:
        user = self.users[role] if role else None
        return RedisSettings(
            url=self.url,
            username=user.name if user else "",
            password=user.password if user else "",
            connect_timeout_s=0.5,
            socket_timeout_s=2.0,
            backoff_base_s=0.02,
            backoff_max_s=0.2,
            reconnect_timeout_s=kw.pop("reconnect_timeout_s", 10.0),  # type: ignore[arg-type]
        )

    def env(self, role: str, **extra: str) -> dict[str, str]:
        """A process of ``role``: the environment `star config acl` told the operator to set."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("STAR_")}
        for line in self.users[role].env(PREFIX).splitlines():
            key, _, value = line.partition("=")
            env[key] = value
        return {**env, "STAR_REDIS_URL": self.url, **extra}

    def stop(self) -> None:
        if self.proc is not None:
            terminate(self.proc)
            self.proc = None


@pytest.fixture(scope="module")
def acl_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[AclRedis]:
    server = AclRedis(tmp_path_factory.mktemp("acl-redis"), role_users(PREFIX))
    server.start()
    yield server
    server.stop()


@pytest.fixture
async def buses(acl_redis: AclRedis) -> AsyncIterator[dict[str, Bus]]:
    out = {
        role: Bus.from_settings(acl_redis.settings(role), BusSettings(prefix=PREFIX, block_ms=100))
        for role in ROLES
    }
    yield out
    for bus in out.values():
        await bus.close()


def _decision(source: str = "a", target: str = "b") -> Decision:
    return Decision(
        id=f"m-{uuid.uuid4().hex[:8]}",
        request="r-1",
        source=source,
        target=target,
        tick=1,
        delta_v=-1.0,
        mode="current",
        ts=time.time(),
        origin="test",
    )


# -- star config acl -------------------------------------------------------------------


def test_star_config_acl_prints_one_user_per_role_bound_to_the_prefix(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["config", "acl", "--prefix", "blue", "--password", "worker=given-pw-1"]) == 0
    out, err = capsys.readouterr()
    lines = out.splitlines()
    assert lines[0].split()[:3] == ["user", "default", "off"]
    users = {line.split()[1]: line.split()[2:] for line in lines[1:]}
    assert set(users) == {f"blue-{r}" for r in ROLES}
    # Each role's environment, once, on stderr: user name, password, prefix.
    env: dict[str, dict[str, str]] = {}
    for block in err.split("\n# ")[1:]:
        role, *assignments = block.strip().splitlines()
        env[role] = dict(a.split("=", 1) for a in assignments)
    assert set(env) == set(ROLES)
    assert env["worker"]["STAR_REDIS_PASSWORD"] == "given-pw-1"
    passwords = {r: env[r]["STAR_REDIS_PASSWORD"] for r in ROLES}
    assert len(set(passwords.values())) == 4 and all(
        len(p) >= 32 for p in list(passwords.values())[1:]
    )
    for role in ROLES:
        rules = users[f"blue-{role}"]
        assert env[role] == {
            "STAR_REDIS_USERNAME": f"blue-{role}",
            "STAR_REDIS_PASSWORD": passwords[role],
            "STAR_BUS_PREFIX": "blue",
        }
        # The ACL file holds the password's SHA-256, never the password.
        assert rules[:2] == ["on", "#" + hashlib.sha256(passwords[role].encode()).hexdigest()]
        assert passwords[role] not in out
        assert (
            "-@all" in rules and "+@all" not in rules and not any(r.startswith("&") for r in rules)
        )
        keys = [r for r in rules if "~" in r]
        assert keys and all(k.split("~", 1)[1].startswith("blue:") for k in keys), keys
    worker = users["blue-worker"]
    assert [r for r in worker if "~" in r] == ["~blue:reports", "~blue:events"]
    assert "+evalsha" in users["blue-scheduler"] and "+evalsha" not in users["blue-proxy"]


def test_star_config_acl_env_dir_and_setuser(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["config", "acl", "--prefix", "c*1", "--env-dir", str(tmp_path), "--setuser"]) == 0
    out, err = capsys.readouterr()
    lines = out.splitlines()
    assert len(lines) == 5 and all(line.startswith("ACL SETUSER ") for line in lines)
    assert lines[-1].startswith("ACL SETUSER default off")  # last: redis-cli may run as it
    assert r"~c\*1:reports" in out  # a glob character in the prefix is a literal
    for role in ROLES:
        path = tmp_path / f"{role}.env"
        assert path.stat().st_mode & 0o777 == 0o600
        password = dict(line.split("=", 1) for line in path.read_text().splitlines())[
            "STAR_REDIS_PASSWORD"
        ]
        assert password not in err and password not in out
    assert main(["config", "acl", "--password", "nobody=x"]) == 2
    assert "x" not in capsys.readouterr().err.split("error:")[1].split("ROLE")[0]


# -- each role's code path with its own user --------------------------------------------


async def test_worker_publishes_reports_and_events_but_no_decision(buses: dict[str, Bus]) -> None:
    worker = buses["worker"]
    await worker.redis.ping()
    entry = await worker.publish("reports", heavy_report("w-0", [100]))
    await worker.publish("events", Event.now(EventKind.WORKER_UP, "w-0", instance="w-0"))
    assert entry in {i for i, _ in await buses["operator"].tail("reports", 50)}
    with pytest.raises(NoPermissionError, match="no permissions"):
        await worker.publish("decisions", _decision())
    with pytest.raises(NoPermissionError):
        await worker.publish_load([], ttl_s=5.0, policy="round-robin")
    with pytest.raises(NoPermissionError):
        await Leadership(worker, "rogue-worker", 5.0).step()
    with pytest.raises(NoPermissionError):  # a worker reads no decisions either
        await Subscriber(worker, "decisions", Decision, start="0").read(block_ms=10)


async def test_scheduler_reads_reports_takes_the_lock_and_publishes(buses: dict[str, Bus]) -> None:
    scheduler, worker, proxy = buses["scheduler"], buses["worker"], buses["proxy"]
    await worker.publish("reports", heavy_report("s-a", [500]))
    # An entry no reader can decode (a worker can write anything to its streams):
    # the scheduler's consumer group dead-letters it.
    await worker.redis.xadd(scheduler.keys.reports, {"body": b"\xc1junk"})
    reader = GroupReader(scheduler, "reports", "sched-test", "node-1", Report, start="0")
    got = await reader.read(block_ms=100)
    assert "s-a" in {e.msg.instance for e in got if isinstance(e.msg, Report)}
    await reader.ack(*(e.id for e in got))
    assert await reader.pending() == 0
    dead = await buses["operator"].tail("dead", 10)
    assert any(f[b"stream"] == scheduler.keys.reports.encode() for _, f in dead)

    lead = Leadership(scheduler, "node-1", 5.0)
    assert await lead.step() and lead.fence >= 1
    assert await lead.step()  # renewal
    decision = _decision("s-a", "s-b")
    assert await lead.publish(decision) is not None
    await scheduler.publish_load(
        [LoadEntry("s-a", "decode", "127.0.0.1:1", 10, 100, 10.0, 1, time.time())],
        ttl_s=5.0,
        policy="round-robin",
    )
    await scheduler.publish("events", Event.now(EventKind.LEADER, "node-1", data={"fence": 1}))
    seen = await Subscriber(scheduler, "decisions", Decision, start="0").read(block_ms=10)
    assert decision.id in {e.msg.id for e in seen if isinstance(e.msg, Decision)}
    assert await lead.current() == ("node-1", lead.fence)

    # The proxy reads what the scheduler wrote, and cannot take the lock.
    view, policy = await proxy.read_dispatch()
    assert set(view) == {"s-a"} and policy == "round-robin"
    with pytest.raises(NoPermissionError):
        await Leadership(proxy, "rogue-proxy", 5.0).step()
    with pytest.raises(NoPermissionError):  # nor write the lock key some other way
        await proxy.redis.set(proxy.keys.leader, "rogue-proxy|99")
    await lead.resign()
    assert await lead.current() is None


async def test_proxy_follows_decisions_and_reports_and_publishes_events(
    buses: dict[str, Bus],
) -> None:
    proxy, scheduler, worker = buses["proxy"], buses["scheduler"], buses["worker"]
    await worker.publish("reports", heavy_report("p-a", [700]))
    directory = Directory(proxy, staleness_s=30.0)
    follow = asyncio.create_task(directory.follow_reports())
    decisions = Subscriber(proxy, "decisions", Decision, start=await proxy.last_id("decisions"))
    lead = Leadership(scheduler, "node-p", 5.0)
    try:
        assert await lead.step()
        decision = _decision("p-a", "p-b")
        await lead.publish(decision)
        got = await decisions.read(block_ms=500)
        assert [e.msg.id for e in got if isinstance(e.msg, Decision)] == [decision.id]
        await directory.refresh()  # the dispatch view (may be empty): a read it may do
        for _ in range(500):
            if "p-a" in directory._reports:
                break
            await asyncio.sleep(0.02)
        assert "p-a" in directory._reports
        event = Event.now(EventKind.RESUMED, "proxy-0", request="r-1", migration=decision.id)
        await proxy.publish("events", event)
        # A bad entry the proxy meets is dead-lettered with its user too.
        await worker.redis.xadd(proxy.keys.reports, {"body": b"\xc1junk"})
        await Subscriber(proxy, "reports", Report, start="0").read(block_ms=10)
    finally:
        follow.cancel()
        await lead.resign()
    with pytest.raises(NoPermissionError, match="no permissions"):
        await proxy.publish("decisions", _decision())
    with pytest.raises(NoPermissionError):
        await proxy.publish("reports", heavy_report("p-forged", [1]))
    with pytest.raises(NoPermissionError):
        await proxy.publish_load([], ttl_s=5.0, policy="round-robin")


def test_operator_runs_star_status_inspect_and_migrate(acl_redis: AclRedis) -> None:
    async def seed() -> None:
        worker = Bus.from_settings(acl_redis.settings("worker"), BusSettings(prefix=PREFIX))
        try:
            await worker.publish("reports", heavy_report("o-a", [300, 200]))
        finally:
            await worker.close()

    asyncio.run(seed())
    star = [sys.executable, "-m", "star.cli.main"]
    env = acl_redis.env("operator")
    for argv in (["status", "--json"], ["inspect", "reports", "-n", "3"], ["inspect", "load"]):
        done = subprocess.run(
            [*star, *argv], env=env, capture_output=True, text=True, timeout=60, check=False
        )
        assert done.returncode == 0, (argv, done.stderr)
        assert "NOPERM" not in done.stdout + done.stderr
    status = json.loads(
        subprocess.run(
            [*star, "status", "--json"], env=env, capture_output=True, text=True, timeout=60
        ).stdout
    )
    assert "o-a" in {i["instance"] for i in status["instances"]}
    done = subprocess.run(
        [*star, "migrate", "o-a-r0", "--to", "o-b"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert "o-a-r0 o-a -> o-b" in done.stdout

    async def refusals() -> None:
        op = Bus.from_settings(acl_redis.settings("operator"), BusSettings(prefix=PREFIX))
        try:
            assert any(f[b"request"] == b"o-a-r0" for _, f in await op.tail("decisions", 20))
            with pytest.raises(NoPermissionError):
                await op.publish("reports", heavy_report("o-forged", [1]))
            with pytest.raises(NoPermissionError):
                await Leadership(op, "rogue-operator", 5.0).step()
        finally:
            await op.close()

    asyncio.run(refusals())


def _start_scheduler(env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    with log.open("wb") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "star.cli.main", "scheduler", "--node", "acl-node"],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )


async def test_scheduler_process_leads_and_decides_with_its_user(acl_redis: AclRedis) -> None:
    """`star scheduler` itself, with the scheduler's user: the lock, decisions and the
    load view as the leader writes them, fed by reports published with the worker's user."""
    prefix_settings = BusSettings(prefix=PREFIX, block_ms=100)
    worker = Bus.from_settings(acl_redis.settings("worker"), prefix_settings)
    proxy = Bus.from_settings(acl_redis.settings("proxy"), prefix_settings)
    decisions = Subscriber(proxy, "decisions", Decision, start=await proxy.last_id("decisions"))
    env = acl_redis.env(
        "scheduler",
        STAR_SCHEDULER_INTERVAL_S="0.1",
        STAR_SCHEDULER_MODE="current",
        STAR_SCHEDULER_STALENESS_S="3.0",
        STAR_SCHEDULER_LOCK_TTL_S="5.0",
        STAR_SCHEDULER_METRICS_PORT="0",
        STAR_LOG_FORMAT="json",
    )
    log = acl_redis.dir / f"scheduler-{uuid.uuid4().hex[:6]}.log"
    proc = _start_scheduler(env, log)

    async def report_forever() -> None:
        seq = 0
        while True:
            seq += 1
            for name, loads in (("h", [4000, 3000, 2500, 2000]), ("l1", [300]), ("l2", [300])):
                await worker.publish("reports", heavy_report(name, loads, seq=seq))
            await asyncio.sleep(0.2)

    reporter = asyncio.create_task(report_forever())
    try:
        deadline = time.monotonic() + 60
        decision: Decision | None = None
        while decision is None and time.monotonic() < deadline:
            assert proc.poll() is None, log.read_text()[-3000:]
            for entry in await decisions.read(block_ms=200):
                if isinstance(entry.msg, Decision) and entry.msg.origin != "test":
                    decision = entry.msg
        assert decision is not None, log.read_text()[-3000:]
        assert decision.source == "h" and decision.fence >= 1
        view, policy = await proxy.read_dispatch()
        while set(view) != {"h", "l1", "l2"} and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
            view, policy = await proxy.read_dispatch()
        assert set(view) == {"h", "l1", "l2"} and policy
    finally:
        reporter.cancel()
        proc.terminate()
        proc.wait(30)
        await worker.close()
        await proxy.close()
    text = log.read_text()
    assert "leadership_acquired" in text and "NOPERM" not in text, text[-3000:]


# -- the default user ------------------------------------------------------------------


async def test_default_user_is_off(acl_redis: AclRedis) -> None:
    anonymous = aioredis.Redis.from_url(acl_redis.url, socket_timeout=2)
    try:
        with pytest.raises(AuthenticationError):
            await anonymous.ping()
    finally:
        await anonymous.aclose()
    for password in ("", "anything"):
        client = aioredis.Redis.from_url(acl_redis.url, username="default", password=password)
        try:
            with pytest.raises(AuthenticationError):
                await client.ping()
        finally:
            await client.aclose()
    # A STAR process with no user set fails at once, naming the setting.
    bus = Bus.from_settings(acl_redis.settings(None), BusSettings(prefix=PREFIX))
    try:
        with pytest.raises(BusUnavailable, match="refused the credentials"):
            await bus.retrying("PING", bus.redis.ping)
    finally:
        await bus.close()
    # And another role's password is not this role's.
    users = acl_redis.users
    wrong = RedisSettings(
        url=acl_redis.url, username=users["scheduler"].name, password=users["proxy"].password
    )
    bus = Bus.from_settings(wrong, BusSettings(prefix=PREFIX))
    try:
        with pytest.raises(BusUnavailable, match="refused the credentials"):
            await bus.retrying("PING", bus.redis.ping)
    finally:
        await bus.close()
