"""A decode worker stopped with SIGTERM hands its running requests over and exits.

The operator's ``systemctl stop`` on the package fleet: the worker drains (no
new streams, reports that say ``draining``), a real scheduler moves its
running request to the other decode instance (a decision with reason
``drain``), the client's stream goes on there and is complete, and the
worker's drain ends with the handoff, long before ``drain_timeout_s`` would
have aborted the request. The worker is started again afterwards, so the
fleet is whole for the next test.
"""

from __future__ import annotations

import asyncio
import signal
import subprocess

from star.bus import Bus
from star.fleet import LocalCluster
from star.wire import EventKind
from tests.migration.conftest import (
    DECODE,
    dispatched_to,
    engine_paused,
    leading_scheduler,
    out_of_the_schedulers_view,
    restart,
    steer_dispatch,
    stop_scheduler,
    stream_with,
    wait_event,
    wait_kv_idle,
    wait_new_worker,
)
from tests.migration.test_fleet import all_events, prompt
from tests.migration.test_fleet import pytestmark as fleet_marks
from tests.migration.test_lost import Log

pytestmark = fleet_marks  # the same fleet, the same skip rule

TOKENS = 3000  # long enough to be running when the drain begins, on a fast engine too
DRAIN_TIMEOUT_S = 30.0  # worker.drain_timeout_s, the default the fleet runs with


async def test_a_stopping_worker_hands_its_request_over_and_exits(
    fleet: LocalCluster, bus: Bus
) -> None:
    source, target = DECODE
    await out_of_the_schedulers_view(bus)
    await steer_dispatch(bus, source)
    old_address = (await bus.latest_reports())[source].address
    child = next(c for c in fleet.launcher.children if c.name == source)
    worker = child.proc
    assert worker is not None and worker.poll() is None, f"{source} is not running"
    log = Log(fleet, source)
    sched: subprocess.Popen[bytes] | None = None
    exit_code: list[int] = []

    async def stop_the_source(rid: str) -> None:
        nonlocal sched
        assert await dispatched_to(bus, rid) == source
        # The engine stands still while the scheduler starts and the stop
        # arrives, so the request is surely running when the drain begins.
        with engine_paused(fleet, source):
            sched = await leading_scheduler(fleet, bus)
            worker.send_signal(signal.SIGTERM)
        moving = await wait_event(
            bus, rid, lambda e: e.event is EventKind.MIGRATING, "migrating", 120
        )
        assert moving.data["reason"] == "drain" and moving.data["origin"] == "scheduler"
        assert moving.data["target"] == target
        # The source had reported the request's predictions since its prompt
        # round, so the handoff carried its length predictor's fusion state.
        released = await wait_event(
            bus, rid, lambda e: e.event is EventKind.RELEASED, "released", 120
        )
        assert released.data["predictor_state"] is True
        await wait_event(bus, rid, lambda e: e.event is EventKind.RESUMED, "resumed", 120)
        exit_code.append(await asyncio.to_thread(worker.wait, 3 * DRAIN_TIMEOUT_S))

    try:
        got = await stream_with(fleet, prompt(77), TOKENS, stop_the_source)
        assert not got.error and got.usage["completion_tokens"] == TOKENS, got
        assert exit_code == [0]
        finished = [e for e in await all_events(bus, got.id) if e.event is EventKind.FINISHED]
        assert finished and finished[-1].instance == target
        # The drain ended with the handoff, not with drain_timeout_s.
        assert "aborting open streams" not in log.since()
    finally:
        if sched is not None:
            stop_scheduler(sched)
        restart(fleet, source)
        await wait_new_worker(bus, fleet, source, old_address)
    await wait_kv_idle(bus)
