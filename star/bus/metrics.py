"""``star_bus_refused_total``: bus entries refused for their signature, on a
role's /metrics (proxy and scheduler register it beside their own)."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, Metric

from star.bus.signing import RefusalCounter


class RefusalCollector:
    """Prometheus custom collector over one bus's :class:`RefusalCounter`."""

    def __init__(self, refusals: RefusalCounter) -> None:
        self.refusals = refusals

    def collect(self) -> Iterator[Metric]:
        family = CounterMetricFamily(
            "star_bus_refused",
            "bus entries (reports, decisions, events, load view, dispatch policy) refused "
            "as unsigned or signed without this cluster.secret",
            labels=["reason"],
        )
        for reason, count in sorted(self.refusals.total.items()):
            family.add_metric([reason], count)
        yield family
