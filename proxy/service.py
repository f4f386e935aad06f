"""``star proxy``: the OpenAI-compatible front end as a long-running process."""

from __future__ import annotations

import asyncio
import os
import socket

import structlog

from proxy import parsing
from proxy.app import ProxyApp, create_server
from proxy.cluster import ClusterBackend, Directory
from proxy.decode_run import follow_decisions
from proxy.http import HttpServer
from proxy.tokenizer import ModelCard
from proxy.upstream import WorkerPool
from star.bus import Bus, BusUnavailable, Outage
from star.bus.metrics import RefusalCollector
from star.process import Service
from star.settings import Settings
from star.wire import Event

log = structlog.get_logger(__name__)


class ProxyService(Service):
    name = "proxy"

    def __init__(
        self,
        settings: Settings,
        model_path: str,
        served_name: str | None = None,
        sock: socket.socket | None = None,
    ) -> None:
        super().__init__(drain_timeout_s=settings.proxy.drain_timeout_s)
        self.settings = settings
        self.model_path = model_path
        self.served_name = served_name
        self.sock = sock
        self.node = f"{socket.gethostname()}-{os.getpid()}"
        self.bus: Bus | None = None
        self.pool = WorkerPool(settings.cluster.secret, settings.cluster.liveness_timeout_s)
        self.server: HttpServer | None = None
        self.app: ProxyApp | None = None
        self.directory: Directory | None = None
        self.backend: ClusterBackend | None = None
        self.events: asyncio.Queue[Event] = asyncio.Queue(maxsize=10_000)

    async def startup(self) -> None:
        card = ModelCard.load(
            self.model_path, self.served_name, max_model_len=self.settings.worker.max_model_len
        )
        self.bus = Bus.for_cluster(self.settings, "proxy")
        await self.bus.retrying("PING", self.bus.redis.ping)
        self.directory = Directory(
            self.bus, self.settings.scheduler.staleness_s, self.settings.proxy.dispatch_charge
        )
        backend = ClusterBackend(
            self.directory,
            self.pool,
            self.settings.proxy.dispatch,
            f"proxy:{self.node}",
            self.events,
            self.settings.proxy.prefill_fallback,
        )
        self.backend = backend
        app = ProxyApp(backend, [card], self.settings.proxy, secret=self.settings.cluster.secret)
        self.app = app
        app.metrics.registry.register(backend)  # star_proxy_prefill_fallbacks_total
        app.metrics.registry.register(RefusalCollector(self.bus.refusals))  # star_bus_refused_total
        parsing.start()  # forking later would stall the loop: start the parse workers now
        self.server = create_server(app, self.settings.proxy, sock=self.sock)
        await self.server.start()
        host, port = self.server.address
        log.info("proxy_listening", url=f"http://{host}:{port}", model=card.name)

    async def main(self) -> None:
        assert self.directory is not None
        self.spawn(self.directory.follow_reports(), "reports")
        self.spawn(self.directory.poll_load(), "load")
        self.spawn(self._publish_events(), "events")
        assert self.bus is not None and self.backend is not None
        max_age_s = self.settings.scheduler.decision_timeout_s
        self.spawn(follow_decisions(self.bus, self.backend.migrator, max_age_s), "decisions")
        await self.wait_exit()

    async def _publish_events(self) -> None:
        assert self.bus is not None
        outage = Outage("events_unpublishable", "events_publishable_again")
        while True:
            event = await self.events.get()
            while True:
                try:
                    await self.bus.publish("events", event)
                    outage.up()
                    break
                except BusUnavailable as exc:  # keep the event and keep serving
                    outage.down(exc, queued=self.events.qsize())

    async def drain(self) -> None:
        if self.server is not None:
            await self.server.shutdown(self.settings.proxy.drain_timeout_s, self._hand_off)
        if self.app is not None:
            self.app.close()  # streams held for a resume: aborted upstream

    def _hand_off(self) -> None:
        """The drain ran out: streams cut now are left to their workers, not aborted.

        With cluster.secret their clients resume on another proxy
        (GET /v1/streams/{last id}); the workers hold them worker.orphan_grace_s.
        """
        if self.backend is not None:
            self.backend.handing_off = True
            log.info("streams_handed_to_workers", streams=len(self.backend.runs))

    async def cleanup(self) -> None:
        await asyncio.to_thread(parsing.shutdown)
        await self.pool.close()
        if self.bus is not None:
            await self.bus.close()
