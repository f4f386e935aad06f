"""A fleet's status from its bus: what ``star status`` prints (``--json`` as is)."""

from __future__ import annotations

import time
from typing import Any

from star.bus import Bus, as_str
from star.settings import Settings
from star.wire import Decision, Event, EventKind, WireError, decode

TERMINAL = {EventKind.RESUMED, EventKind.ABORTED, EventKind.REFUSED, EventKind.EXPIRED}


async def collect(settings: Settings) -> dict[str, Any]:
    """The status document: every instance's newest report (fresh or stale),
    the decisions not yet resolved and the latest ten, the scheduler leader."""
    bus = Bus.for_cluster(settings, "operator")
    try:
        latest = await bus.latest_reports(2000)
        decisions = bus.signed("decisions", await bus.tail("decisions", 200))
        events = bus.signed("events", await bus.tail("events", 2000))
        leader_raw = await bus.retrying("GET", lambda: bus.redis.get(bus.keys.leader))
    finally:
        await bus.close()
    now = time.time()
    instances = []
    for r in sorted(latest.values(), key=lambda r: (r.role, r.instance)):
        age = now - r.ts
        instances.append(
            {
                "instance": r.instance,
                "role": r.role,
                "address": r.address,
                "fresh": age <= settings.scheduler.staleness_s,
                "draining": r.draining,
                # A length predictor loaded (None: not said: a prefill worker or an older build).
                "predictor": r.predictor,
                "age_s": round(age, 2),
                "used_tokens": r.used_tokens,
                "capacity_tokens": r.capacity_tokens,
                "kv_percent": round(100 * r.used_tokens / r.capacity_tokens, 1)
                if r.capacity_tokens
                else 0.0,
                "step_ms": round(r.step_time_s * 1000, 2),
                "waiting": r.waiting,
                "preemptions": r.preemptions,
                # Token-protocol peers that failed the handshake (a wrong cluster.secret, a probe).
                "refused_peers": r.refused_peers,
                "requests": [
                    {
                        "id": q.id,
                        "tokens": q.tokens,
                        "generated": q.generated,
                        "predicted_remaining": q.predicted_remaining,
                        "true_remaining": q.true_remaining,
                    }
                    for q in r.requests
                ],
            }
        )
    resolved: dict[str, str] = {}
    for _id, raw in events:
        ev = _decode(raw)
        if isinstance(ev, Event) and ev.event in TERMINAL and ev.migration:
            resolved[ev.migration] = ev.event.value
    in_flight = []
    recent = []
    for _id, raw in decisions:
        d = _decode(raw)
        if not isinstance(d, Decision):
            continue
        row = {
            "id": d.id,
            "request": d.request,
            "source": d.source,
            "target": d.target,
            "age_s": round(now - d.ts, 2),
            "origin": d.origin,
            "reason": d.reason,
        }
        outcome = resolved.get(d.id)
        if outcome is None and now - d.ts <= settings.scheduler.decision_timeout_s:
            in_flight.append(row)
        recent.append(
            {**row, "outcome": outcome or ("in flight" if row in in_flight else "unknown")}
        )
    leader = None
    if leader_raw:
        node, _, fence = as_str(leader_raw).rpartition("|")
        leader = {"node": node, "fence": int(fence or 0)}
    return {
        "instances": instances,
        "in_flight": in_flight,
        "recent_migrations": recent[-10:],
        "leader": leader,
    }


def _decode(raw: dict[bytes, bytes]) -> object:
    try:
        return decode(raw.get(b"body", b""))
    except WireError:
        return None
