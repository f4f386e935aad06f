"""Dispatch skips an instance that refuses connections (dead, reports not yet stale)."""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any

import msgspec
import pytest

from proxy.backend import BackendUnavailable
from proxy.cluster import ClusterBackend, Directory
from star.bus import Bus
from star.wire import LoadEntry, Report
from tests.reports import report


class Pool:
    """Connections succeed except to ``dead`` addresses (connection refused)."""

    def __init__(self, dead: set[str]) -> None:
        self.dead = dead
        self.tried: list[str] = []

    async def get(self, address: str) -> Any:
        self.tried.append(address)
        if address in self.dead:
            raise ConnectionRefusedError(f"connect to {address} refused")
        return object()


def backend(reports: list[Report], dead: set[str]) -> tuple[ClusterBackend, Pool]:
    bus = SimpleNamespace(keys=SimpleNamespace(reports="t:reports"))  # only named in errors
    directory = Directory(bus, staleness_s=60)  # type: ignore[arg-type]
    for r in reports:
        directory._reports[r.instance] = (time.monotonic(), r)
    pool = Pool(dead)
    return ClusterBackend(directory, pool, "current-load", "test"), pool  # type: ignore[arg-type]


async def test_a_dead_decode_instance_is_skipped_for_a_live_one() -> None:
    # decode-0 is the least loaded, so current-load picks it first; it is dead.
    b, pool = backend(
        [
            report("decode-0", address="h:1"),
            report("decode-1", address="h:2", used=500),
            report("decode-2", address="h:3", used=900),
        ],
        dead={"h:1"},
    )
    member = await b.pick_reachable("decode", "current-load", 10)
    assert member.instance == "decode-1"
    assert pool.tried == ["h:1", "h:2"]
    # Marked down: the next request does not try it again.
    assert (await b.pick_reachable("decode", "current-load", 10)).instance in {
        "decode-1",
        "decode-2",
    }
    assert pool.tried.count("h:1") == 1


async def test_503_only_when_no_instance_is_reachable() -> None:
    b, pool = backend(
        [report("decode-0", address="h:1"), report("decode-1", address="h:2")],
        dead={"h:1", "h:2"},
    )
    with pytest.raises(BackendUnavailable, match="no decode instance is up"):
        await b.pick_reachable("decode", "round-robin", 10)
    assert sorted(pool.tried) == ["h:1", "h:2"]


async def test_prefill_too() -> None:
    b, _ = backend(
        [
            report("prefill-0", role="prefill", address="h:1"),
            report("prefill-1", role="prefill", address="h:2", used=10),
        ],
        dead={"h:1"},
    )
    assert (await b.pick_reachable("prefill", "current-load", 10)).instance == "prefill-1"


async def test_stale_reports_are_tried_when_nothing_is_fresh() -> None:
    # Reports lag on a starved host or while Redis is down: the last known
    # instances are still tried, and a dead one is dropped at its first refusal.
    b, pool = backend(
        [report("decode-0", address="h:1"), report("decode-1", address="h:2", used=500)],
        dead={"h:1"},
    )
    long_ago = time.monotonic() - 3600
    for name, (_t, r) in list(b.directory._reports.items()):
        b.directory._reports[name] = (long_ago, r)
    assert (await b.pick_reachable("decode", "current-load", 10)).instance == "decode-1"
    assert pool.tried == ["h:1", "h:2"]
    # A fresh report wins over stale ones again.
    b.directory._reports["decode-2"] = (
        time.monotonic(),
        report("decode-2", address="h:3", used=900),
    )
    assert [m.instance for m in b.directory.members("decode")] == ["decode-2"]


async def test_a_draining_instance_gets_no_new_streams_nor_migrations() -> None:
    # decode-0 is the least loaded and reachable, but its worker is stopping.
    draining = msgspec.structs.replace(report("decode-0", address="h:1"), draining=True)
    b, pool = backend([draining, report("decode-1", address="h:2", used=900)], dead=set())
    assert (await b.pick_reachable("decode", "current-load", 10)).instance == "decode-1"
    assert pool.tried == ["h:2"]
    assert b.decode_address("decode-0") is None  # not a migration target either
    assert b.decode_address("decode-1") == "h:2"


# -- the dispatch policy the scheduler publishes ---------------------------------------


def load_view() -> list[LoadEntry]:
    # decode-0 holds fewer tokens now, decode-1 less work over the horizon:
    # current-load picks decode-0, predicted decode-1.
    now = time.time()
    return [
        LoadEntry("decode-0", "decode", "h:1", 100, 10_000, 5000.0, 1, now),
        LoadEntry("decode-1", "decode", "h:2", 900, 10_000, 1000.0, 1, now),
    ]


class ViewBus:
    """What Directory reads of the bus: the load view and the policy published with it."""

    def __init__(self, policy: str | None) -> None:
        self.keys = SimpleNamespace(reports="t:reports")
        self.policy = policy

    async def read_dispatch(self) -> tuple[dict[str, LoadEntry], str | None]:
        return {e.instance: e for e in load_view()}, self.policy


async def scheduler_backend(policy: str | None, fallback: str) -> ClusterBackend:
    directory = Directory(ViewBus(policy), staleness_s=60)  # type: ignore[arg-type]
    await directory.refresh()
    return ClusterBackend(directory, Pool(set()), fallback, "test")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("published", "fallback", "picks"),
    [
        ("predicted", "current-load", ["decode-1", "decode-1", "decode-1"]),
        ("round-robin", "current-load", ["decode-0", "decode-1", "decode-0"]),
        ("current-load", "predicted", ["decode-0", "decode-0", "decode-0"]),
        # No scheduler publishes one: proxy.dispatch.
        (None, "current-load", ["decode-0", "decode-0", "decode-0"]),
        (None, "predicted", ["decode-1", "decode-1", "decode-1"]),
        # A policy this build does not know is ignored.
        ("fastest", "current-load", ["decode-0", "decode-0", "decode-0"]),
    ],
)
async def test_decode_dispatch_follows_the_scheduler_s_policy(
    published: str | None, fallback: str, picks: list[str]
) -> None:
    b = await scheduler_backend(published, fallback)
    assert [(await b.pick_decode(10)).instance for _ in picks] == picks


async def test_a_policy_no_longer_published_gives_way_to_proxy_dispatch() -> None:
    b = await scheduler_backend("predicted", "current-load")
    assert (await b.pick_decode(10)).instance == "decode-1"
    # Read more than staleness_s ago and not since (the scheduler is gone).
    when, policy = b.directory._policy  # type: ignore[misc]
    b.directory._policy = (when - 61.0, policy)
    assert (await b.pick_decode(10)).instance == "decode-0"


async def test_the_policy_travels_through_redis_beside_the_load_view(bus: Bus) -> None:
    await bus.publish_load(load_view(), ttl_s=5, policy="predicted")
    directory = Directory(bus, staleness_s=60)
    await directory.refresh()
    b = ClusterBackend(directory, Pool(set()), "current-load", "test")  # type: ignore[arg-type]
    assert (await b.pick_decode(10)).instance == "decode-1"
    # A reader of the hash alone (an older proxy) sees the same entries, nothing else.
    assert set(await bus.read_load()) == {"decode-0", "decode-1"}

    # A view published without a policy (an older scheduler) once the old one expired.
    await bus.redis.delete(bus.keys.dispatch)
    await bus.publish_load(load_view(), ttl_s=5)
    fresh = Directory(bus, staleness_s=60)
    await fresh.refresh()
    b = ClusterBackend(fresh, Pool(set()), "current-load", "test")  # type: ignore[arg-type]
    assert (await b.pick_decode(10)).instance == "decode-0"
    assert await bus.redis.get(bus.keys.dispatch) is None


@pytest.mark.parametrize(("charge", "second"), [("expected", "decode-1"), ("prompt", "decode-0")])
def test_a_decode_dispatch_books_its_expected_footprint_until_the_next_view(
    charge: str, second: str
) -> None:
    # Between two views the least loaded instance would take every request
    # (a herd): booked at its prompt plus the mean output seen so far, one
    # request already outweighs decode-1's lead.
    bus = SimpleNamespace(keys=SimpleNamespace(reports="t:reports"))
    directory = Directory(bus, staleness_s=60, charge=charge)  # type: ignore[arg-type]
    for r in (report("decode-0", used=0), report("decode-1", used=1000)):
        directory._reports[r.instance] = (time.monotonic(), r)
    directory.finished(1500)
    directory.finished(2500)  # mean output: 2,000 tokens
    assert directory.pick("decode", "current-load", 10).instance == "decode-0"
    assert directory._pending["decode-0"] == (2010 if charge == "expected" else 10)
    assert directory.pick("decode", "current-load", 10).instance == second
    # A prefill pick books the prompt alone (its KV leaves with the handoff).
    prefill = Directory(bus, staleness_s=60, charge=charge)  # type: ignore[arg-type]
    prefill._reports["prefill-0"] = (time.monotonic(), report("prefill-0", role="prefill"))
    prefill.finished(2000)
    prefill.pick("prefill", "current-load", 10)
    assert prefill._pending["prefill-0"] == 10


# -- the simulator's rule (star.planner.dispatch.choose_on_view) -----------------------


async def test_without_a_scheduler_the_rule_runs_on_the_workers_reports() -> None:
    # No load view, no published policy: proxy.dispatch on the reports. decode-0
    # holds the least but has no room for the request; decode-1 has.
    b, _ = backend(
        [
            report("decode-0", address="h:1", used=1_000, capacity=1_500),
            report("decode-1", address="h:2", used=2_000, capacity=10_000),
        ],
        dead=set(),
    )
    assert b.directory.policy(b.policy) == "current-load"
    assert (await b.pick_decode(1000)).instance == "decode-1"
    assert (await b.pick_decode(10)).instance == "decode-0"  # 11 tokens fit
    # Reports gone stale (a starved host, Redis down): the same rule on the last known.
    long_ago = time.monotonic() - 3600
    for name, (_t, r) in list(b.directory._reports.items()):
        b.directory._reports[name] = (long_ago, r)
    b.directory._pending.clear()
    assert (await b.pick_decode(1000)).instance == "decode-1"
    # Nobody has room: the least loaded anyway, not a 503.
    assert (await b.pick_decode(50_000)).instance == "decode-0"


async def test_predicted_passes_over_an_instance_without_room() -> None:
    # decode-1 has the least work over the horizon but cannot hold the request now.
    now = time.time()
    view = [
        LoadEntry("decode-0", "decode", "h:1", 100, 10_000, 5000.0, 1, now),
        LoadEntry("decode-1", "decode", "h:2", 9_900, 10_000, 1000.0, 1, now),
    ]
    bus = SimpleNamespace(keys=SimpleNamespace(reports="t:reports"))

    async def read_dispatch() -> tuple[dict[str, LoadEntry], str]:
        return {e.instance: e for e in view}, "predicted"

    bus.read_dispatch = read_dispatch
    directory = Directory(bus, staleness_s=60)  # type: ignore[arg-type]
    await directory.refresh()
    b = ClusterBackend(directory, Pool(set()), "current-load", "test")  # type: ignore[arg-type]
    assert (await b.pick_decode(500)).instance == "decode-0"
    assert (await b.pick_decode(10)).instance == "decode-1"


async def test_round_robin_counts_decode_picks_alone() -> None:
    # Each request picks a prefill instance first: one counter for both roles
    # sent every request to the same one of two decode instances.
    b, _ = backend(
        [
            report("prefill-0", role="prefill", address="h:0"),
            report("decode-0", address="h:1"),
            report("decode-1", address="h:2"),
        ],
        dead=set(),
    )
    picks = []
    for _ in range(4):
        await b.pick_reachable("prefill", "current-load", 10)
        picks.append((await b.pick_reachable("decode", "round-robin", 11)).instance)
    assert picks == ["decode-0", "decode-1", "decode-0", "decode-1"]
