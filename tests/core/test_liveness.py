"""The heartbeat rule of a token-protocol connection end (star.liveness), as a table."""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable

import pytest

from star.liveness import PING_FRACTION, Due, Heartbeat, Verdict, check, may_drop, watch

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
    await asyncio.wait_for(watch(beat, pings.append, _dies(dead)), 5)
    took = loop.time() - start
    assert pings == [1, 2, 3]
    assert len(dead) == 1 and dead[0] >= bound
    assert bound <= took < bound + 0.15


async def test_watch_stays_quiet_while_bytes_come_in() -> None:
    loop = asyncio.get_running_loop()
    beat = Heartbeat(0.2, loop.time())
    pings: list[int] = []
    task = asyncio.create_task(watch(beat, pings.append, lambda s: True))
    for _ in range(20):  # a byte every 20 ms for 0.4 s: twice the bound
        await asyncio.sleep(0.02)
        beat.last_received = loop.time()
    assert not task.done()
    assert pings == []
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


@pytest.mark.parametrize(
    ("last_received", "due", "now", "excused", "after"),
    [
        (10.0, 10.5, 10.5, 0.0, 10.0),  # woke on time: nothing excused
        (10.0, 10.5, 10.4, 0.0, 10.0),  # early (timer rounding): nothing
        (10.0, 10.5, 13.0, 2.5, 12.5),  # stalled 2.5 s past the due time: not the peer's
        (10.0, 10.5, 10.501, 0.001, 10.001),  # a millisecond late: a millisecond
        (12.0, 10.5, 13.0, 1.0, 13.0),  # heard during the stall: only since then, up to now
    ],
)
def test_excuse_moves_the_silence_past_our_own_stall(
    last_received: float, due: float, now: float, excused: float, after: float
) -> None:
    beat = Heartbeat(T, last_received)
    assert beat.excuse(due, now) == pytest.approx(excused)
    assert beat.last_received == pytest.approx(after)
    assert beat.last_received <= now


def _dies(dead: list[float]) -> Callable[[float], bool]:
    """A ``dead`` callback that drops the connection (and notes the silence)."""

    def drop(silent_s: float) -> bool:
        dead.append(silent_s)
        return True

    return drop


@pytest.mark.parametrize(
    ("silent_s", "others", "drop"),
    [
        (2.0, [0.3], True),  # one silent peer among answering ones: dead
        (2.0, [0.3, 2.1], True),  # another silent too, but one answers
        (2.0, [1.9, 2.05], False),  # every peer silent at once: this end's stall, wait
        (2.0, [], True),  # the only connection: nothing says it is this end's stall
        (9.99, [1.9], False),
        (10.0, [1.9], True),  # five bounds: dropped whatever the rest say
        (10.0, [], True),
        (2.0, [0.999], True),  # heard within half the bound: a working connection
        (2.0, [1.0], False),
    ],
)
def test_may_drop_only_among_peers_that_answer(
    silent_s: float, others: list[float], drop: bool
) -> None:
    assert may_drop(silent_s, 2.0, others) is drop


async def test_watch_keeps_pinging_a_peer_whose_drop_was_declined() -> None:
    loop = asyncio.get_running_loop()
    bound = 0.2
    beat = Heartbeat(bound, loop.time())
    pings: list[int] = []
    asked: list[float] = []

    def dead(silent_s: float) -> bool:
        asked.append(silent_s)
        return len(asked) >= 3  # declined twice, then dropped

    start = loop.time()
    await asyncio.wait_for(watch(beat, pings.append, dead), 5)
    took = loop.time() - start
    assert len(asked) == 3 and asked[0] >= bound
    assert asked[1] - asked[0] == pytest.approx(bound / 4, abs=0.05)  # asked again each interval
    assert len(pings) == 5  # three before the bound, one after each declined drop
    assert bound + 2 * bound / 4 <= took < bound + 2 * bound / 4 + 0.15


def _stall(seconds: float) -> None:
    """Hold the running event loop (a callback that does not return, a starved process)."""
    time.sleep(seconds)


def _answering(beat: Heartbeat, rtt_s: float) -> Callable[[int], None]:
    """A live peer: each Ping is answered ``rtt_s`` later (on the same loop, so a stall of
    the loop stalls it too, as a whole box starved of CPU does)."""
    loop = asyncio.get_running_loop()

    def ping(seq: int) -> None:
        loop.call_later(rtt_s, lambda: setattr(beat, "last_received", loop.time()))

    return ping


async def test_watch_does_not_drop_a_live_peer_after_a_stall_of_its_own_loop() -> None:
    """Issue 26: a loop stalled past the bound (time.sleep here; CPU starvation under a
    load average of 8 in the chaos run) woke with nothing read and no Ping sent during
    the stall, and declared the peer dead at once. Now the stall is excused and the
    peer is pinged first: it answers, and stays."""
    loop = asyncio.get_running_loop()
    bound = 0.4
    beat = Heartbeat(bound, loop.time())
    dead: list[float] = []
    task = asyncio.create_task(watch(beat, _answering(beat, 0.01), _dies(dead)))
    await asyncio.sleep(0.25)  # beats on time: pinged and answered
    assert beat.pings >= 1 and not dead
    _stall(2.5 * bound)  # this loop stalls for 2.5 bounds
    await asyncio.sleep(1.5 * bound)
    assert dead == []
    assert not task.done()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_watch_still_drops_a_silent_peer_after_a_stall_within_the_rest_of_the_bound() -> None:
    """A peer silent before and after our stall: dropped once ``bound`` of silence has
    passed on time (here 0.15 s before the stall), i.e. about 0.25 s after it."""
    loop = asyncio.get_running_loop()
    bound = 0.4
    beat = Heartbeat(bound, loop.time())
    dead: list[float] = []
    pings: list[int] = []
    task = asyncio.create_task(watch(beat, pings.append, _dies(dead)))
    await asyncio.sleep(0.15)
    _stall(1.0)
    stall_end = loop.time()
    await asyncio.wait_for(task, 5)
    took = loop.time() - stall_end
    assert len(dead) == 1
    assert 0.1 <= took < bound + 0.1
    assert len(pings) >= 2  # one at once after the stall


async def test_watch_drops_a_silent_peer_at_the_bound_on_a_busy_but_timely_loop() -> None:
    """Short callbacks keep the loop busy (never past a due time by much): nothing to
    excuse, so a silent peer is still dropped at the bound."""
    loop = asyncio.get_running_loop()
    bound = 0.3
    beat = Heartbeat(bound, loop.time())
    dead: list[float] = []
    start = loop.time()
    task = asyncio.create_task(watch(beat, lambda seq: None, _dies(dead)))
    while not task.done():
        _stall(0.002)  # 2 ms of work per turn
        await asyncio.sleep(0)
    took = loop.time() - start
    assert len(dead) == 1
    assert bound <= took < bound + 0.1
