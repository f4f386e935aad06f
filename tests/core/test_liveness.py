"""The heartbeat rule of a token-protocol connection end (star.liveness), as a table."""

from __future__ import annotations

import asyncio
import math

import pytest

from star.liveness import PING_FRACTION, Due, Heartbeat, Verdict, check, watch

T = 2.0  # the bound; a Ping after T / 4 = 0.5 s of silence
NEVER = -math.inf

WAIT, PING, DEAD = Verdict.WAIT, Verdict.PING, Verdict.DEAD


@pytest.mark.parametrize(
    ("last_received", "last_ping", "now", "expected"),
    [
        # just heard from the peer: nothing to do until a quarter of the bound
        (10.0, NEVER, 10.0, Due(WAIT, 10.5)),
        (10.0, NEVER, 10.49, Due(WAIT, 10.5)),
        # a quarter of the bound without a byte: ping, check again a quarter later
        (10.0, NEVER, 10.5, Due(PING, 11.0)),
        (10.0, NEVER, 10.7, Due(PING, 11.2)),
        # pinged, no answer yet: the next Ping a quarter after the last one
        (10.0, 10.5, 10.6, Due(WAIT, 11.0)),
        (10.0, 10.5, 11.0, Due(PING, 11.5)),
        (10.0, 11.5, 11.9, Due(WAIT, 12.0)),  # the next check is the deadline, not a Ping
        # the answer came: the clock starts again from it
        (10.8, 10.5, 11.0, Due(WAIT, 11.3)),
        (10.8, 10.5, 11.3, Due(PING, 11.8)),
        # a ping due late, close to the deadline: the check after it is the deadline
        (10.0, NEVER, 11.8, Due(PING, 12.0)),
        # nothing for the whole bound: dead, pings or not
        (10.0, 11.5, 12.0, Due(DEAD, 12.0)),
        (10.0, NEVER, 12.0, Due(DEAD, 12.0)),
        (10.0, 11.9, 30.0, Due(DEAD, 30.0)),
        # a Ping sent more recently than the last receipt counts from the Ping
        (10.0, 10.2, 10.6, Due(WAIT, 10.7)),
    ],
)
def test_check(last_received: float, last_ping: float, now: float, expected: Due) -> None:
    got = check(T, last_received, last_ping, now)
    assert got.verdict is expected.verdict
    assert got.at == pytest.approx(expected.at)


def test_a_silent_peer_gets_pings_then_is_dead_at_the_bound() -> None:
    """Walk the checks one due time after another: Pings every quarter, death at T."""
    beat = Heartbeat(T, last_received=0.0)
    now, trail = 0.0, []
    while True:
        due = beat.poll(now)
        trail.append((now, due.verdict))
        if due.verdict is DEAD:
            break
        if due.verdict is PING:
            beat.pinged(now)
        now = due.at
    assert trail == [
        (0.0, WAIT),
        (0.5, PING),
        (1.0, PING),
        (1.5, PING),
        (2.0, DEAD),
    ]
    assert beat.pings == PING_FRACTION - 1


def test_a_peer_that_answers_is_never_dead() -> None:
    beat = Heartbeat(T, last_received=0.0)
    now = 0.0
    for _ in range(100):
        due = beat.poll(now)
        assert due.verdict is not DEAD
        if due.verdict is PING:
            beat.pinged(now)
            beat.last_received = now + 0.05  # the Pong, 50 ms later
        now = due.at
    assert now > 10 * T


async def test_watch_pings_then_declares_dead_once() -> None:
    loop = asyncio.get_running_loop()
    bound = 0.2
    beat = Heartbeat(bound, loop.time())
    pings: list[int] = []
    dead: list[float] = []
    start = loop.time()
    await asyncio.wait_for(watch(beat, pings.append, dead.append), 5)
    took = loop.time() - start
    assert pings == [1, 2, 3]
    assert len(dead) == 1 and dead[0] >= bound
    assert bound <= took < bound + 0.15


async def test_watch_stays_quiet_while_bytes_come_in() -> None:
    loop = asyncio.get_running_loop()
    beat = Heartbeat(0.2, loop.time())
    pings: list[int] = []
    task = asyncio.create_task(watch(beat, pings.append, lambda s: None))
    for _ in range(20):  # a byte every 20 ms for 0.4 s: twice the bound
        await asyncio.sleep(0.02)
        beat.last_received = loop.time()
    assert not task.done()
    assert pings == []
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
