"""``redis.sentinels`` and friends: parsing, validation, masking, the client the
factory builds; and the leader's fence rules, table-tested without Sentinel."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import io
import os
import types
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio as aioredis
from redis.asyncio.sentinel import MasterNotFoundError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ReadOnlyError, ResponseError
from structlog.testing import capture_logs

from scheduler.leader import Leadership
from star.bus import Bus, BusUnavailable, connect_redis
from star.cli.main import main
from star.ports import free_port
from star.redis_sentinel import SentinelMaster, Sentinels, describe
from star.settings import (
    RedisSettings,
    SentinelAddress,
    SettingsError,
    as_dict,
    load_settings,
    parse_sentinel,
    secret_values,
)
from tests.conftest import bus_settings, redis_settings
from tests.redis_server import RedisServer


@pytest.mark.parametrize(
    ("entry", "parsed"),
    [
        ("10.0.0.1:26380", SentinelAddress("10.0.0.1", 26380, None)),
        ("sentinel-a", SentinelAddress("sentinel-a", 26379, None)),
        (" [::1]:5000 ", SentinelAddress("::1", 5000, None)),
        ("redis://s1:26379", SentinelAddress("s1", 26379, False)),
        ("rediss://s1", SentinelAddress("s1", 26379, True)),
        ("redis://:p%40ss@s1:1", SentinelAddress("s1", 1, False, None, "p@ss")),
        ("redis://watch:pw@s1:2/", SentinelAddress("s1", 2, False, "watch", "pw")),
    ],
)
def test_sentinel_entries(entry: str, parsed: SentinelAddress) -> None:
    assert parse_sentinel(entry) == parsed


@pytest.mark.parametrize(
    "entry",
    [
        "s1:notaport",
        "s1:70000",
        "s1:0",
        "redis://s1:0",
        "http://s1:1",
        "unix:///run/sentinel.sock",
        "redis://s1:1/2",
        "redis://:sekrit-pw@s1:1/0",
        "redis://s1:1?password=sekrit-pw",
        "user:sekrit-pw@s1:1",
    ],
)
def test_bad_sentinel_entries_are_refused_without_their_password(entry: str) -> None:
    with pytest.raises(SettingsError, match=r"redis\.sentinels") as err:
        load_settings(env={"STAR_REDIS_SENTINELS": f"good:1,{entry}"})
    assert "sekrit-pw" not in str(err.value)


def test_empty_entries_are_no_entries() -> None:
    assert load_settings(env={"STAR_REDIS_SENTINELS": " , "}).redis.sentinels == ()


def test_sentinel_settings_from_env_and_toml(tmp_path: Any) -> None:
    env = load_settings(env={"STAR_REDIS_SENTINELS": "a:1, b:2", "STAR_REDIS_SERVICE_NAME": "bus"})
    assert env.redis.sentinels == ("a:1", "b:2") and env.redis.service_name == "bus"
    path = tmp_path / "star.toml"
    path.write_text(
        '[redis]\nsentinels = ["a:1", "redis://b:2"]\nsentinel_password = "pw-of-the-sentinels"\n'
    )
    toml = load_settings(config=path, env={})
    assert toml.redis.sentinels == ("a:1", "redis://b:2")
    assert RedisSettings().sentinels == () and RedisSettings().service_name == "mymaster"
    with pytest.raises(SettingsError, match=r"redis\.service_name: must not be empty"):
        load_settings(env={"STAR_REDIS_SERVICE_NAME": ""})


def test_sentinel_passwords_are_masked_everywhere(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in [k for k in os.environ if k.startswith("STAR_")]:
        monkeypatch.delenv(key)
    env = {
        "STAR_REDIS_SENTINELS": "redis://:url-pw-1234@s1:1,redis://:url-pw-1234@s2:2",
        "STAR_REDIS_SENTINEL_PASSWORD": "setting-pw-5678",
    }
    settings = load_settings(env=env)
    assert {"url-pw-1234", "setting-pw-5678"} <= set(secret_values(settings))
    shown = [repr(settings.redis), str(as_dict(settings)), describe(settings.redis)]
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    for fmt in ([], ["--json"], ["--toml"], ["--markdown"]):
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            assert main(["config", "show", *fmt]) == 0
        shown.append(out.getvalue())
    for text in shown:
        assert "url-pw-1234" not in text and "setting-pw-5678" not in text
    assert "redis://:***@s1:1" in shown[0] and "s2:2" in shown[2]


async def test_the_factory_builds_a_sentinel_client_with_the_settings() -> None:
    settings = RedisSettings(
        url="redis://ignored:1/3?health_check_interval=7",
        username="star",
        password="master-pw",
        sentinels=("s1:1", "redis://:sent-pw@s2:2"),
        sentinel_password="",
        service_name="bus",
        socket_timeout_s=3.0,
        connect_timeout_s=1.5,
    )
    with pytest.raises(SettingsError, match=r"same scheme .* same\s+credentials"):
        connect_redis(settings)
    settings = RedisSettings(
        **{**_fields(settings), "sentinels": ("s1:1", "s2:2"), "sentinel_password": "sent-pw"}
    )
    client = connect_redis(settings)
    try:
        assert isinstance(client, SentinelMaster)
        pool: Any = client.connection_pool
        assert pool.service_name == "bus" and pool.is_master
        kw = pool.connection_kwargs
        assert (kw["db"], kw["username"], kw["password"]) == (3, "star", "master-pw")
        assert (kw["socket_timeout"], kw["socket_connect_timeout"]) == (3.0, 1.5)
        assert "host" not in kw and "port" not in kw
        sentinels = pool.sentinel_manager.sentinels
        assert [
            (
                s.connection_pool.connection_kwargs["host"],
                s.connection_pool.connection_kwargs["port"],
            )
            for s in sentinels
        ] == [("s1", 1), ("s2", 2)]
        assert sentinels[0].connection_pool.connection_kwargs["password"] == "sent-pw"
        assert sentinels[0].connection_pool.connection_kwargs["socket_timeout"] == 3.0
        assert "Dropping" in pool.connection_class.__name__
    finally:
        await client.aclose()
    with pytest.raises(SettingsError, match="unix://"):
        connect_redis(RedisSettings(url="unix:///run/redis.sock", sentinels=("s1:1",)))


async def test_a_connection_busy_when_the_master_switched_leaves_it(
    own_redis: RedisServer, tmp_path: Path
) -> None:
    """A connection in use while the Sentinels named another master is dropped
    before its next command, also when redis-py's pool (a connection opened
    meanwhile), not the follower, noticed the switch."""
    (tmp_path / "new").mkdir()
    new = RedisServer(tmp_path / "new", persistent=False)
    new.start()
    named = [("127.0.0.1", own_redis.port)]

    async def discover(_service: str) -> tuple[str, int]:
        return named[0]

    client = connect_redis(RedisSettings(sentinels=(f"127.0.0.1:{free_port()}",)))
    pool: Any = client.connection_pool
    pool.sentinel_manager.discover_master = discover
    old = aioredis.Redis(port=own_redis.port)
    try:
        busy = await pool.get_connection()
        assert busy.port == own_redis.port
        named[0] = ("127.0.0.1", new.port)
        await client.ping()  # a second connection: the pool asks and takes the new master
        assert tuple(pool.master_address) == named[0]
        await pool.release(busy)
        await client.set("where", "here")
        assert await old.get("where") is None  # nothing written to the old master
        assert await client.get("where") == b"here"
    finally:
        await old.aclose()
        await client.aclose()
        new.stop()


async def test_closing_a_client_keeps_a_cancel_of_the_closer() -> None:
    client = connect_redis(RedisSettings(sentinels=(f"127.0.0.1:{free_port()}",)))
    assert isinstance(client, SentinelMaster)
    client.follow()
    closing = asyncio.create_task(client.aclose())
    await asyncio.sleep(0)  # closing waits for the follower to end
    closing.cancel()
    with pytest.raises(asyncio.CancelledError):
        await closing
    assert client._follower is None


class _Sentinel:
    """A Sentinel client that fails at once (``down``) or answers when ``gate`` opens."""

    def __init__(
        self, host: str, gate: asyncio.Event, down: bool = False, error: Exception | None = None
    ) -> None:
        self.connection_pool = types.SimpleNamespace(connection_kwargs={"host": host, "port": 1})
        self.gate, self.down, self.error = gate, down, error

    async def sentinel_masters(self) -> dict[str, Any]:
        if self.error is not None:
            raise self.error
        if self.down:
            raise RedisConnectionError("refused")
        await self.gate.wait()
        state = {"ip": "10.0.0.1", "port": 6379, "is_master": True, "is_sdown": False}
        return {"bus": {**state, "is_odown": False, "num-other-sentinels": 0}}


async def test_concurrent_lookups_keep_every_sentinel() -> None:
    """The follower and a connection opening ask at once; the one that answered
    moves to the front, and no Sentinel is lost from the list (nor doubled)."""
    gate = asyncio.Event()
    down, answers, third = (
        _Sentinel("s0", gate, down=True),
        _Sentinel("s1", gate),
        _Sentinel("s2", gate),
    )
    sentinels = Sentinels([("s0", 1), ("s1", 1), ("s2", 1)])  # type: ignore[no-untyped-call]
    sentinels.sentinels = [down, answers, third]
    try:
        lookups = [asyncio.create_task(sentinels.discover_master("bus")) for _ in range(2)]
        await asyncio.sleep(0)
        gate.set()
        assert await asyncio.gather(*lookups) == [("10.0.0.1", 6379)] * 2
        assert sentinels.sentinels[0] is answers
        assert {id(s) for s in sentinels.sentinels} == {id(down), id(answers), id(third)}
    finally:
        sentinels.sentinels = []


async def test_an_error_reply_of_one_sentinel_leaves_the_others() -> None:
    gate = asyncio.Event()
    gate.set()
    noperm = ResponseError("NOPERM User watch has no permissions to run the 'sentinel|masters'")
    sentinels = Sentinels([("s0", 1), ("s1", 1)])  # type: ignore[no-untyped-call]
    sentinels.sentinels = [_Sentinel("s0", gate, error=noperm), _Sentinel("s1", gate)]
    try:
        assert await sentinels.discover_master("bus") == ("10.0.0.1", 6379)
        sentinels.sentinels = [_Sentinel("s0", gate, error=noperm)]
        with pytest.raises(MasterNotFoundError, match=r"s0:1: NOPERM"):
            await sentinels.discover_master("bus")
    finally:
        sentinels.sentinels = []


def _fields(settings: RedisSettings) -> dict[str, Any]:
    return {f.name: getattr(settings, f.name) for f in dataclasses.fields(settings)}


async def test_no_sentinel_answering_is_an_outage_with_the_sentinels_named() -> None:
    settings = RedisSettings(
        sentinels=(f"127.0.0.1:{free_port()}",),
        service_name="bus",
        connect_timeout_s=0.2,
        backoff_base_s=0.02,
        backoff_max_s=0.05,
        reconnect_timeout_s=0.3,
    )
    bus = Bus.from_settings(settings, bus_settings())
    try:
        with pytest.raises(BusUnavailable, match=r"master 'bus' of Sentinels 127\.0\.0\.1:"):
            await bus.publish("events", _event())
    finally:
        await bus.close()


def _event() -> Any:
    from star.wire import Event, EventKind

    return Event.now(EventKind.LEADER, "test")


# -- the fence rules (scheduler/leader.py) -----------------------------------


class FakeRedis:
    """ROLE and WAIT answers as a master with ``replicas`` replicas, ``acked`` of which acknowledge."""

    def __init__(self, role: str, replicas: int, acked: int) -> None:
        self.role, self.replicas, self.acked = role, replicas, acked
        self.calls: list[tuple[Any, ...]] = []

    def register_script(self, _script: str) -> None:
        return None

    async def execute_command(self, *args: Any) -> Any:
        self.calls.append(args)
        if args[0] == "ROLE":
            if self.role == "master":
                return [b"master", 10, [[b"127.0.0.1", b"1", b"10"]] * self.replicas]
            return [b"slave", b"127.0.0.1", 1, b"connected", 10]
        assert args[0] == "WAIT" and args[1] == self.replicas
        return self.acked


class FakeBus:
    def __init__(self, redis: FakeRedis) -> None:
        self.redis = redis
        self.redis_settings = RedisSettings(socket_timeout_s=2.0)


@pytest.mark.parametrize(
    ("role", "replicas", "acked", "used", "waited"),
    [
        ("master", 0, 0, True, False),  # standalone: nothing to wait for
        ("master", 1, 1, True, True),
        ("master", 2, 2, True, True),
        ("master", 2, 1, False, True),  # every replica, not a majority
        ("master", 1, 0, False, True),
        ("slave", 0, 0, True, False),  # a replica refuses the script before this
    ],
)
async def test_a_fence_is_used_once_every_replica_has_it(
    role: str, replicas: int, acked: int, used: bool, waited: bool
) -> None:
    redis = FakeRedis(role, replicas, acked)
    lead = Leadership(FakeBus(redis), "n", ttl_s=1.5)  # type: ignore[arg-type]
    with capture_logs() as logs:
        assert await lead._replicated(7) is used
    waits = [c for c in redis.calls if c[0] == "WAIT"]
    assert bool(waits) is waited
    if waits:
        assert waits[0][2] == 750  # ttl/2, under half the socket timeout (1 s)
    assert any(e["event"] == "leadership_not_replicated" for e in logs) is (not used)


class RefusingRedis(FakeRedis):
    async def execute_command(self, *args: Any) -> Any:
        self.calls.append(args)
        raise self.error

    def __init__(self, error: Exception) -> None:
        super().__init__("master", 1, 0)
        self.error = error


async def test_a_redis_without_role_or_wait_is_taken_as_one_without_replicas() -> None:
    redis = RefusingRedis(
        ResponseError("NOPERM User star-scheduler has no permissions to run 'role'")
    )
    lead = Leadership(FakeBus(redis), "n", ttl_s=1.5)  # type: ignore[arg-type]
    with capture_logs() as logs:
        assert await lead._replicated(1) is True
        assert await lead._replicated(2) is True
    assert [e["event"] for e in logs] == ["fence_replication_unchecked"]  # once
    # An outage reply is no refusal: it goes up, and the step fails.
    lead = Leadership(FakeBus(RefusingRedis(ReadOnlyError("You can't write"))), "n", ttl_s=1.5)  # type: ignore[arg-type]
    with pytest.raises(ReadOnlyError):
        await lead._replicated(1)


async def test_a_standby_never_takes_a_fence_at_or_below_one_it_saw(own_redis: RedisServer) -> None:
    bus = Bus.from_settings(redis_settings(own_redis), bus_settings())
    try:
        a, b, c = (Leadership(bus, n, ttl_s=5) for n in "abc")
        for _ in range(4):  # a leads with fence 4
            await bus.redis.delete(bus.keys.leader)
            a.demote()
            assert await a.step()
        assert a.fence == 4
        assert await b.step() is False and b.seen == 4
        # A promoted replica without the latest INCRs: the counter is behind,
        # and a's lock is gone with them.
        await bus.redis.set(bus.keys.fence, 1)
        await bus.redis.delete(bus.keys.leader)
        assert await b.step() is True and b.fence == 5
        assert await bus.redis.get(bus.keys.fence) == b"5"  # stored: the next one is 6
        await bus.redis.delete(bus.keys.leader)
        assert await c.step() is True and c.fence == 6
    finally:
        await bus.close()
