"""Liveness of a token-protocol connection: heartbeats and a deadline, without IO.

A peer that goes silent (a partition that drops packets, no RST; a host that
froze) leaves a TCP connection open for as long as it lasts: reads just wait.
So each end of a token-protocol connection (``cluster.liveness_timeout_s``,
:data:`DEFAULT_TIMEOUT_S`) keeps one rule:

* whatever arrives (any byte: a frame, part of one, a Ping, a Pong) proves
  the peer alive: :attr:`Heartbeat.last_received`;
* after ``timeout_s / PING_FRACTION`` with nothing received, send a
  :class:`~star.wire.Ping` (again every such interval while nothing comes);
  the peer answers every Ping with a :class:`~star.wire.Pong` at once;
* with nothing received for ``timeout_s``, the peer is dead: drop the
  connection (the proxy's streams on it get ``ConnectionLost``, the worker
  aborts the connection's requests, as on a closed connection).

Silence counts only while this end's own event loop was on time. A loop that
could not run (starved of CPU under load, or held by a long callback) sent
no Ping and read nothing meanwhile, so the peer had nothing to answer and no
chance to be heard: the time :func:`watch` woke past its due time is
excused (:meth:`Heartbeat.excuse`), and the check goes on from the end of
the stall, with a Ping at once. Before this, a loop stalled past the bound
declared a live peer dead as soon as it woke (issue 26: both decode workers
dropped a proxy under a load average of 8). A peer that is really silent is
still dropped after ``timeout_s`` of silence on time: one that goes silent
while this loop is stalled, as soon as the rest of the bound has passed
after the stall.

Pinging on *receive* silence (not send silence) keeps both ends fed: a
worker streaming tokens hears nothing from the proxy, so it pings and the
proxy's Pongs come back; the proxy hears the tokens and sends no Ping. An
idle connection carries one Ping and one Pong per interval.

:func:`check` is the whole rule (table-tested); :class:`Heartbeat` holds one
connection's clock readings; :func:`watch` is the one periodic check per
connection that drives it (no timer per frame: a reader stores one float per
read).
"""

from __future__ import annotations

import asyncio
import enum
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass

DEFAULT_TIMEOUT_S = 2.0
"""``cluster.liveness_timeout_s``'s default: a silent peer is dropped within this."""
PING_FRACTION = 4
"""A Ping goes out after ``timeout_s / PING_FRACTION`` of silence: three go unanswered before death."""
LATE_FRACTION = 0.2
"""A check that runs later than this fraction of the ping interval past its due time (0.1 s
with the default bound) found this end's loop stalled: the time past the due time is excused.
Less is timer jitter, counted as usual."""


class Verdict(enum.Enum):
    WAIT = "wait"  # nothing to do before ``Due.at``
    PING = "ping"  # send a Ping now, then check again at ``Due.at``
    DEAD = "dead"  # nothing received for the whole timeout: drop the connection


@dataclass(frozen=True, slots=True)
class Due:
    verdict: Verdict
    at: float  # when to check next (the same clock as the inputs); ``now`` when DEAD


def check(timeout_s: float, last_received: float, last_ping: float, now: float) -> Due:
    """What a connection's end does at ``now``: wait, ping, or declare the peer dead.

    ``last_received``: when the last byte came in (or the connection was
    armed); ``last_ping``: when this end last sent a Ping (``-inf``: never).
    """
    dead_at = last_received + timeout_s
    if now >= dead_at:
        return Due(Verdict.DEAD, now)
    interval = timeout_s / PING_FRACTION
    ping_at = max(last_received, last_ping) + interval
    if now >= ping_at:
        return Due(Verdict.PING, min(now + interval, dead_at))
    return Due(Verdict.WAIT, min(ping_at, dead_at))


@dataclass(slots=True)
class Heartbeat:
    """One connection end's readings; readers store :attr:`last_received` on every read."""

    timeout_s: float
    last_received: float
    last_ping: float = -math.inf
    pings: int = 0  # Pings sent (the next one's ``seq``)

    def poll(self, now: float) -> Due:
        return check(self.timeout_s, self.last_received, self.last_ping, now)

    def pinged(self, now: float) -> int:
        """Note a Ping sent at ``now``; its sequence number."""
        self.last_ping = now
        self.pings += 1
        return self.pings

    def silent_for(self, now: float) -> float:
        return now - self.last_received

    def excuse(self, due: float, now: float) -> float:
        """This end's loop woke at ``now`` for a check due at ``due``: the silence since
        ``due`` was a stall of ours, not the peer's. Moves :attr:`last_received` past it
        (never beyond ``now``); the seconds excused."""
        start = max(due, self.last_received)
        if now <= start:
            return 0.0
        self.last_received += now - start
        return now - start


HEARD_FRACTION = 0.5
"""A connection whose peer was heard within this fraction of the bound is one that works."""
ALONE_BOUNDS = 5
"""Silent for this many bounds, a connection is dropped whatever the others say."""


def may_drop(silent_s: float, timeout_s: float, others_silent_s: Iterable[float]) -> bool:
    """Whether a connection silent for ``silent_s`` (past the bound) may be dropped, given how
    long the peer of each other connection of this end has been silent.

    One silent peer among others that answer is dead (or cut off): drop it and
    go elsewhere; so is the only one (nothing says otherwise). Every peer
    silent at once says more about this end, its box or its network than
    about the peers (a machine starved of CPU: every worker late by two
    seconds together, issue 26), and dropping them all leaves nowhere to go:
    wait, up to :data:`ALONE_BOUNDS` bounds of silence.
    """
    others = list(others_silent_s)
    if silent_s >= timeout_s * ALONE_BOUNDS or not others:
        return True
    return any(s < timeout_s * HEARD_FRACTION for s in others)


async def watch(
    beat: Heartbeat, ping: Callable[[int], None], dead: Callable[[float], bool]
) -> None:
    """Drive ``beat`` on the running loop until the peer is declared dead.

    ``ping(seq)`` writes a Ping; ``dead(silent_s)`` drops the connection and
    returns True (then this returns), or declines to (False: :func:`may_drop`
    said wait) and the check goes on, pinging. One sleep per due time: on an idle
    connection about one wake-up per ping interval, nothing per frame. A wake
    later than its due time by more than :data:`LATE_FRACTION` of the ping
    interval (this loop stalled) excuses the stall (:meth:`Heartbeat.excuse`).
    """
    loop = asyncio.get_running_loop()
    late_s = beat.timeout_s / PING_FRACTION * LATE_FRACTION
    woke_for = loop.time()
    while True:
        now = loop.time()
        if now - woke_for > late_s:
            beat.excuse(woke_for, now)
        due = beat.poll(now)
        if due.verdict is Verdict.DEAD:
            # A loop that was stalled past the deadline may hold bytes it has
            # not read yet: let the reader run (three turns: I/O callback, its
            # task, this one) before believing the silence.
            for _ in range(3):
                await asyncio.sleep(0)
            now = loop.time()
            if beat.poll(now).verdict is Verdict.DEAD:
                if dead(beat.silent_for(now)):
                    return
                # Not dropped: ping on, and look again after an interval.
                ping(beat.pinged(now))
                woke_for = now + beat.timeout_s / PING_FRACTION
                await asyncio.sleep(beat.timeout_s / PING_FRACTION)
                continue
            woke_for = now
            continue
        if due.verdict is Verdict.PING:
            ping(beat.pinged(now))
        woke_for = due.at
        await asyncio.sleep(max(0.0, due.at - loop.time()))


__all__ = [
    "ALONE_BOUNDS",
    "DEFAULT_TIMEOUT_S",
    "HEARD_FRACTION",
    "LATE_FRACTION",
    "PING_FRACTION",
    "Due",
    "Heartbeat",
    "Verdict",
    "check",
    "may_drop",
    "watch",
]
