"""Per-role bus keys (star.bus.signing): each kind is accepted only from the roles
allowed to write it, and a process given only its role's keyring cannot sign as
another role: a worker's or proxy's keyring can sign no decision, no load view,
no dispatch policy."""

from __future__ import annotations

import asyncio
import contextlib
import os
import stat
import time
import uuid
from pathlib import Path

import pytest

from proxy.cluster import Directory
from proxy.decode_run import follow_decisions
from star.bus import Bus, parse_dead
from star.bus.metrics import RefusalCollector
from star.bus.signing import (
    BAD_SIGNATURE,
    ROLES,
    WRONG_ROLE,
    Keyring,
    KeyringError,
    Signer,
    new_keyrings,
)
from star.cli.main import main
from star.fleet.manual import migrate
from star.settings import ClusterSettings, Settings
from star.wire import Decision, LoadEntry, decode_as
from tests.conftest import redis_settings
from tests.proxy.fakes import Recorder
from tests.redis_server import RedisServer
from tests.scheduler.reports import report

SECRET = "s3cret-of-this-cluster"
RINGS = new_keyrings()


def as_role(bus: Bus, keys: str | Keyring, role: str | None = None) -> Bus:
    return Bus(bus.redis, bus.settings, bus.redis_settings, keys, role)


def decision(id: str) -> Decision:
    return Decision(id, "r-" + id, "d0", "d1", 0, -1.0, "manual", time.time(), 0, "manual")


@pytest.mark.parametrize(
    ("kind", "writers"),
    [
        ("reports", {"worker"}),
        ("decisions", {"scheduler", "operator"}),
        ("load", {"scheduler"}),
        ("dispatch", {"scheduler"}),
        ("events", set(ROLES)),
    ],
)
def test_each_kind_only_from_its_roles(kind: str, writers: set[str]) -> None:
    reader, body, name = Signer(SECRET), b"\x81\xa1k\xa1x", f"star:{kind}"
    for role in ROLES:
        sig = Signer(SECRET, role).sign(name, body)
        assert sig.startswith(role + ":")
        assert reader.check(name, body, sig) == (None if role in writers else WRONG_ROLE)


def test_a_role_keyring_holds_no_other_signing_key() -> None:
    body, decisions, load = b"x", "star:decisions", "star:load"
    for role in ("worker", "proxy"):
        ring = RINGS[role]
        assert set(ring.private) == set()
        for other in ("scheduler", "operator"):
            with pytest.raises(KeyringError, match="no signing key"):
                Signer(ring, other).sign(decisions, body)
    assert set(RINGS["worker"].hmac_keys) == {"worker"}
    assert set(RINGS["proxy"].hmac_keys) == {"worker", "proxy"}
    assert set(RINGS["scheduler"].private) == {"scheduler"}
    assert set(RINGS["operator"].private) == {"operator"}
    # What the scheduler's keyring signs, the proxy's checks (a public key only).
    sig = Signer(RINGS["scheduler"]).sign(load, body)
    assert Signer(RINGS["proxy"]).check(load, body, sig) is None
    assert Signer(RINGS["proxy"]).check(load, body + b"!", sig) == BAD_SIGNATURE
    # A keyring from another draw (or the secret's keys) is another cluster's.
    assert Signer(new_keyrings()["proxy"]).check(load, body, sig) == BAD_SIGNATURE
    assert Signer(SECRET).check(load, body, sig) == BAD_SIGNATURE


def test_keyring_files_round_trip_and_refuse_garbage() -> None:
    for role, ring in RINGS.items():
        back = Keyring.from_json(ring.to_json())
        assert back.role == role
        assert back.hmac_keys == ring.hmac_keys and set(back.private) == set(ring.private)
        sig = Signer(ring).sign("star:events", b"e")
        assert Signer(RINGS["operator"]).check("star:events", b"e", sig) is None
    for text in ("", "{}", '{"star_keyring": 1, "role": "root"}', '{"star_keyring": 1}'):
        with pytest.raises(KeyringError):
            Keyring.from_json(text)


async def test_a_worker_signed_decision_is_dead_lettered_and_counted(bus: Bus) -> None:
    worker = as_role(bus, RINGS["worker"])
    proxy = as_role(bus, RINGS["proxy"])
    await worker.publish("decisions", decision("from-a-worker"))
    await proxy.publish("decisions", decision("from-a-proxy"))
    await as_role(bus, RINGS["operator"]).publish("decisions", decision("star-migrate"))
    await as_role(bus, RINGS["scheduler"]).publish("decisions", decision("the-leader"))
    migrator = Recorder()
    reader = as_role(bus, RINGS["proxy"])
    follower = asyncio.create_task(follow_decisions(reader, migrator, 15.0, start="0-0"))
    try:
        deadline = time.monotonic() + 10
        while len(migrator.applied) < 2 and time.monotonic() < deadline:  # noqa: ASYNC110
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.3)
    finally:
        follower.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await follower
    assert migrator.applied == ["star-migrate", "the-leader"]
    rows: list[tuple[bytes, dict[bytes, bytes]]] = await bus.redis.xrange(bus.keys.dead)  # type: ignore[assignment]
    dead = [parse_dead(i.decode(), f) for i, f in rows]
    assert [(d.reason, decode_as(d.body, Decision).id) for d in dead] == [
        (WRONG_ROLE, "from-a-worker"),
        (WRONG_ROLE, "from-a-proxy"),
    ]
    [family] = RefusalCollector(reader.refusals).collect()
    assert {s.labels["reason"]: s.value for s in family.samples} == {WRONG_ROLE: 2}


async def test_a_load_view_from_a_proxy_keyring_is_not_followed(bus: Bus) -> None:
    entry = LoadEntry("decode-0", "decode", "6.6.6.6:1", 10, 1000, 1.0, 1, time.time())
    await as_role(bus, RINGS["proxy"]).publish_load([entry], ttl_s=5, policy="round-robin")
    directory = Directory(as_role(bus, RINGS["proxy"]), staleness_s=60)
    await directory.refresh()
    assert directory.members("decode") == []
    assert directory.policy("current-load") == "current-load"
    await as_role(bus, RINGS["scheduler"]).publish_load([entry], ttl_s=5, policy="round-robin")
    await directory.refresh()
    assert [m.address for m in directory.members("decode")] == ["6.6.6.6:1"]
    assert directory.policy("current-load") == "round-robin"


async def test_reports_from_a_worker_keyring_reach_the_directory(bus: Bus) -> None:
    await as_role(bus, RINGS["worker"]).publish("reports", report("decode-0", [10]))
    await as_role(bus, RINGS["scheduler"]).publish("reports", report("decode-1", [10]))
    latest = await as_role(bus, RINGS["proxy"]).latest_reports()
    assert sorted(latest) == ["decode-0"]


def test_star_config_keyring_writes_one_private_file_per_role(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["config", "keyring", "--out", str(tmp_path / "keys")]) == 0
    files = sorted((tmp_path / "keys").iterdir())
    assert [f.name for f in files] == [f"{r}.keyring" for r in sorted(ROLES)]
    for f in files:
        assert stat.S_IMODE(os.stat(f).st_mode) == 0o600
        assert Keyring.load(f).role == f.stem
    assert "cluster.keyring" in capsys.readouterr().err


async def test_star_migrate_signs_as_the_operator_of_its_keyring(bus: Bus, tmp_path: Path) -> None:
    """``star migrate`` (star.fleet.manual.migrate) with the operator's keyring file is
    applied; given a worker's file it refuses to sign, and a decision written with
    the worker's key anyway is dead-lettered as wrong_role."""
    for role in ("operator", "worker"):
        (tmp_path / f"{role}.keyring").write_text(RINGS[role].to_json())

    def settings(role: str) -> Settings:
        keyring = str(tmp_path / f"{role}.keyring")
        return Settings(
            redis=bus.redis_settings, bus=bus.settings, cluster=ClusterSettings(keyring=keyring)
        )

    mine, _ = await migrate(settings("operator"), "r-1", "decode-1", source="decode-0")
    with pytest.raises(KeyringError, match="no signing key for role 'operator'"):
        await migrate(settings("worker"), "r-2", "decode-1", source="decode-0")
    # Written by hand with the worker's key (what a compromised worker host can do).
    await as_role(bus, RINGS["worker"]).publish("decisions", decision("by-a-worker"))
    migrator = Recorder()
    reader = as_role(bus, RINGS["proxy"])
    follower = asyncio.create_task(follow_decisions(reader, migrator, 15.0, start="0-0"))
    try:
        deadline = time.monotonic() + 10
        while not migrator.applied and time.monotonic() < deadline:  # noqa: ASYNC110
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.3)
    finally:
        follower.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await follower
    assert migrator.applied == [mine.id]
    assert reader.refusals.total == {WRONG_ROLE: 1}


def test_star_migrate_with_a_worker_keyring_says_so_in_one_line(
    redis_server: RedisServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "worker.keyring"
    path.write_text(RINGS["worker"].to_json())
    env = {
        "STAR_CLUSTER_KEYRING": str(path),
        "STAR_REDIS_URL": redis_settings(redis_server).url,
        "STAR_BUS_PREFIX": f"t{uuid.uuid4().hex[:8]}",
    }
    with pytest.MonkeyPatch.context() as mp:
        for k, v in env.items():
            mp.setenv(k, v)
        code = main(["migrate", "r-1", "--to", "decode-1", "--from", "decode-0"])
    assert code == 2
    err = capsys.readouterr().err
    assert "no signing key for role 'operator'" in err and "Traceback" not in err


def test_a_service_given_another_roles_keyring_fails_at_start(tmp_path: Path) -> None:
    path = tmp_path / "worker.keyring"
    path.write_text(RINGS["worker"].to_json())
    settings = Settings(cluster=ClusterSettings(keyring=str(path)))
    for role in ("proxy", "scheduler"):
        with pytest.raises(KeyringError, match=f"worker's: it cannot sign as the {role}"):
            Bus.for_cluster(settings, role)
    Bus.for_cluster(settings, "operator")  # star status, star inspect: reading only
    Bus.for_cluster(settings, "worker")
