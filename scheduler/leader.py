"""One leader publishes: a Redis lock with a TTL and a fencing token.

Acquiring the lock (``SET NX PX``) and taking the next fencing token
(``INCR <prefix>:fence``) happen in one Lua script; the lock's value is
``<node>|<token>``. The leader renews the TTL every ``ttl/3``; a standby
tries to acquire every ``ttl/5``, so after a leader is killed a standby
takes over within about ``ttl + ttl/5``.

Every decision is published by a script that XADDs only if the lock still
holds this node's value — a leader that was paused past its TTL (GC, a
stopped VM) and lost the lock cannot publish stale decisions afterwards.

The fence never repeats, also across a failover of a replicated Redis
(Sentinel). Replication is asynchronous: a replica promoted to master may
lack the newest ``INCR`` of ``<prefix>:fence``, and the next ``INCR`` on it
would hand the same number out again. Two rules prevent that:

1. *Replicated before used.* After the lock script, the new leader asks the
   master for its replicas (``ROLE``) and, if it has any, waits for every one
   of them to acknowledge the script's writes (``WAIT <n> <ttl/2>``). Only
   then is the fence used (kept as leader, in the ``leader`` event and in
   decisions). Without every acknowledgement in time it releases the lock and
   stays a standby: that number is never used, so a failover that loses it
   loses nothing. Sentinel promotes a replica, never a server outside the
   master's replica set, so a promoted master holds every used fence (a
   replica that was disconnected while the fence was taken, and is promoted
   nonetheless, is what rule 2 covers).
2. *A floor from what was seen.* Each scheduler remembers the highest fence
   it has seen: its own, and the holder's, read from the lock on every
   attempt a standby makes (every ``ttl/5``). The lock script takes
   ``max(INCR <prefix>:fence, floor + 1)`` and stores it. So while one
   scheduler that saw fence F is alive, no fence <= F is handed out again,
   whatever the new master's ``<prefix>:fence`` says.

A standalone Redis (no replicas) skips the wait: a fence is then as durable
as the server's persistence (with AOF ``appendfsync always``, every one). So
does a Redis that refuses ROLE or WAIT, with one warning.
"""

from __future__ import annotations

from typing import Any

import structlog
from redis.exceptions import ResponseError

from star.bus import Bus, as_str
from star.bus.connection import TRANSIENT
from star.wire import Decision

log = structlog.get_logger(__name__)

# Returns the new fence (> 0) when acquired, else minus the holder's fence
# (0 if the lock's value carries none). ARGV[3] is the caller's floor.
_ACQUIRE = """
if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then
  local fence = redis.call('INCR', KEYS[2])
  local floor = tonumber(ARGV[3])
  if fence <= floor then
    fence = floor + 1
    redis.call('SET', KEYS[2], fence)
  end
  redis.call('SET', KEYS[1], ARGV[1] .. '|' .. fence, 'PX', ARGV[2])
  return fence
end
local held = redis.call('GET', KEYS[1])
local fence = held and tonumber(string.match(held, '|(%d+)$')) or 0
return -fence
"""

_RENEW = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 0
"""

_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
"""

_PUBLISH = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then
  return false
end
return redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[2], '*', unpack(ARGV, 3))
"""


class Leadership:
    """Leader state of one scheduler node."""

    def __init__(self, bus: Bus, node: str, ttl_s: float) -> None:
        self.bus = bus
        self.node = node
        self.ttl_ms = max(1, int(ttl_s * 1000))
        self.fence = 0
        self.seen = 0  # the highest fence this node has seen (rule 2 above)
        self._unchecked = False  # warned that ROLE/WAIT are refused
        self._value = ""
        redis = bus.redis
        self._acquire = redis.register_script(_ACQUIRE)
        self._renew = redis.register_script(_RENEW)
        self._release = redis.register_script(_RELEASE)
        self._publish = redis.register_script(_PUBLISH)

    @property
    def is_leader(self) -> bool:
        return self.fence > 0

    async def step(self) -> bool:
        """Renew (leader) or try to acquire (standby); returns whether we lead now."""
        keys = self.bus.keys
        if self.is_leader:
            ok = await self._renew(keys=[keys.leader], args=[self._value, self.ttl_ms])
            if not ok:
                log.warning("leadership_lost", node=self.node, fence=self.fence)
                self.fence = 0
                self._value = ""
            return self.is_leader
        fence = int(
            await self._acquire(
                keys=[keys.leader, keys.fence], args=[self.node, self.ttl_ms, self.seen]
            )
        )
        self.seen = max(self.seen, abs(fence))
        if fence <= 0:
            return False
        value = f"{self.node}|{fence}"
        if not await self._replicated(fence):
            await self._release(keys=[keys.leader], args=[value])
            return False
        self.fence = fence
        self._value = value
        log.info("leadership_acquired", node=self.node, fence=fence)
        return self.is_leader

    async def _replicated(self, fence: int) -> bool:
        """Whether every replica of the master acknowledged the lock script (rule 1 above).

        A Redis that refuses ROLE or WAIT (an ACL user made before they were
        needed, a managed Redis without them) is taken as one without
        replicas, as before rule 1, with one warning: rule 2 still holds.
        """
        redis = self.bus.redis
        try:
            role = await redis.execute_command("ROLE")  # type: ignore[no-untyped-call]
            replicas = len(role[2]) if as_str(role[0]) == "master" else 0
            if not replicas:
                return True
            # WAIT blocks this connection: bounded by half the TTL and by the socket timeout.
            timeout_ms = max(
                1, min(self.ttl_ms // 2, int(self.bus.redis_settings.socket_timeout_s * 500))
            )
            acked = int(await redis.execute_command("WAIT", replicas, timeout_ms))  # type: ignore[no-untyped-call]
        except ResponseError as exc:
            if isinstance(exc, TRANSIENT):
                raise  # an outage: the caller steps down and tries again
            if not self._unchecked:
                self._unchecked = True
                log.warning(
                    "fence_replication_unchecked",
                    node=self.node,
                    error=str(exc),
                    hint="grant the scheduler's Redis user +role +wait (star config acl)",
                )
            return True
        if acked < replicas:
            log.warning(
                "leadership_not_replicated",
                node=self.node,
                fence=fence,
                replicas=replicas,
                acknowledged=acked,
                hint="the fence is not used; a standby again, the next attempt takes a new one",
            )
            return False
        return True

    def demote(self) -> None:
        """Forget leadership locally (e.g. after Redis was unreachable past the TTL)."""
        self.fence = 0
        self._value = ""

    async def resign(self) -> None:
        """Give the lock up at shutdown so a standby takes over at once."""
        if self.is_leader:
            await self._release(keys=[self.bus.keys.leader], args=[self._value])
            self.demote()

    async def publish(self, decision: Decision) -> str | None:
        """XADD the decision iff we still hold the lock; returns the entry id or None."""
        if not self.is_leader:
            return None
        keys = self.bus.keys
        fields: list[Any] = []
        # Signed as Bus.publish signs (with cluster.secret): the tag covers the body.
        for k, v in self.bus.entry_fields(keys.decisions, decision).items():
            fields += [k, v]
        entry = await self._publish(
            keys=[keys.leader, keys.decisions],
            args=[self._value, self.bus.settings.maxlen_decisions, *fields],
        )
        if entry is None:
            log.warning("publish_refused_lock_lost", node=self.node, decision=decision.id)
            self.demote()
            return None
        return entry.decode() if isinstance(entry, bytes) else str(entry)

    async def current(self) -> tuple[str, int] | None:
        """Who leads now: ``(node, fence)`` or None."""
        raw = await self.bus.redis.get(self.bus.keys.leader)
        if not raw:
            return None
        node, _, fence = as_str(raw).rpartition("|")
        return node, int(fence or 0)
