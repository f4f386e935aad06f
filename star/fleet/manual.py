"""A manual migration decision: what ``star migrate`` publishes (docs/design.md §5).

The source is looked up in the workers' latest reports unless named. The
owning proxy reads the decision from ``<prefix>:decisions`` in order; with
``wait`` :func:`migrate` follows ``<prefix>:events`` until the migration
resolves (``resumed``, ``refused`` or ``aborted``).
"""

from __future__ import annotations

import time
import uuid

from star.bus import Bus, Subscriber
from star.fleet.errors import FleetError
from star.settings import Settings
from star.wire import Decision, Event, EventKind

OUTCOMES = {EventKind.RESUMED, EventKind.REFUSED, EventKind.ABORTED}


async def find_source(bus: Bus, request: str) -> str:
    """The instance whose latest report lists ``request`` ('' if none does)."""
    for report in (await bus.latest_reports()).values():
        if any(r.id == request for r in report.requests):
            return report.instance
    return ""


def manual_decision(request: str, source: str, target: str) -> Decision:
    """A decision of origin ``manual`` that moves ``request`` from ``source`` to ``target``.

    Raises :class:`FleetError` if the request or the target is empty, or the
    request is already on the target.
    """
    if not request or not target:
        raise FleetError("REQUEST and --to must not be empty")
    if source and source == target:
        raise FleetError(f"the request is already on {target}")
    return Decision(
        id=f"manual-{uuid.uuid4().hex[:12]}",
        request=request,
        source=source,
        target=target,
        tick=0,
        delta_v=0.0,
        mode="manual",
        ts=time.time(),
        origin="manual",
    )


async def migrate(
    settings: Settings,
    request: str,
    target: str,
    source: str = "",
    wait: bool = False,
    timeout_s: float = 30.0,
) -> tuple[Decision, Event | None]:
    """Publish the decision; with ``wait``, return the event that resolved it."""
    bus = Bus.for_cluster(settings, "operator")
    try:
        source = source or await find_source(bus, request)
        decision = manual_decision(request, source, target)
        events = Subscriber(bus, "events", Event, start=await bus.last_id("events"))
        await bus.publish("decisions", decision)
        if not wait:
            return decision, None
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for entry in await events.read(block_ms=200):
                ev = entry.msg
                if isinstance(ev, Event) and ev.migration == decision.id and ev.event in OUTCOMES:
                    return decision, ev
        return decision, None
    finally:
        await bus.close()
