"""``star worker``: one vLLM engine, its token server, and its reports.

Start-up builds the engine (in a thread, so signals still work), opens the
token server and announces ``worker_up``. The report loop wakes every
``report_every_steps`` decode steps or ``report_interval_s`` seconds,
whichever comes first, and XADDs a :class:`~star.wire.Report` built from the
engine's own numbers (docs/design.md §4). SIGTERM drains: no new streams, running
ones finish within ``drain_timeout_s`` (the reports go on, marked
``draining``), then ``worker_down`` and the engine stops. An engine that
dies under the worker stops the reports and the worker (exit status 1,
``worker_down`` announced): fresh reports of a dead engine would keep it a
dispatch and migration target.
"""

from __future__ import annotations

import asyncio
import time

import structlog

from star.bus import Bus, BusUnavailable, Outage
from star.ports import listen
from star.process import Service
from star.settings import Settings, SettingsError
from star.wire import Event, EventKind, Hello
from workers.engine import EngineHandle
from workers.engine_config import EngineSpec
from workers.pacing import DeviceClock, StepTimes
from workers.protocol import EngineDead
from workers.server import InsecureBind, TokenServer, check_bind
from workers.state import EngineStats, build_report
from workers.tap_client import start_tap

log = structlog.get_logger(__name__)


class WorkerService(Service):
    name = "worker"

    def __init__(self, settings: Settings) -> None:
        super().__init__(drain_timeout_s=settings.worker.drain_timeout_s + 15)
        self.settings = settings
        cfg = settings.worker
        try:
            check_bind(cfg.host, settings.cluster.secret)
        except InsecureBind as exc:
            raise SettingsError(str(exc)) from None
        # Bound now, not after the engine's start: a port merely picked could be
        # taken by then (star.ports).
        self.sock = listen(cfg.host, cfg.port)
        self.port = int(self.sock.getsockname()[1])
        self.instance = cfg.instance or f"{cfg.role}-{cfg.host}-{self.port}"
        self.spec = EngineSpec.from_settings(
            cfg,
            nixl_secret=settings.cluster.secret,
            # The served model's: the engine's structured outputs start after its reasoning.
            reasoning_parser=settings.proxy.reasoning_parser,
        )
        self.engine: EngineHandle | None = None
        self.server: TokenServer | None = None
        self.bus: Bus | None = None
        self.seq = 0
        # This run of the process (star.report_gate): its reports count from 1 in it.
        self.incarnation = time.time_ns() // 1000
        self.predictor: bool | None = None  # reported: a length predictor is loaded
        self._report_now = asyncio.Event()  # set when the drain begins: say so at once

    async def startup(self) -> None:
        cfg = self.settings.worker
        self.bus = Bus.for_cluster(self.settings, "worker")
        await self.bus.retrying("PING", self.bus.redis.ping)
        self.engine = await EngineHandle.start(self.spec)
        pred = self.settings.predictor
        self.note_predictor(await start_tap(self.engine, pred.every_k, pred.checkpoint))
        if cfg.role == "decode":
            # Step times for the reports; padded to a device's under emulated timing.
            clock = DeviceClock(
                cfg.device_step_ms / 1e3,
                cfg.device_us_per_token / 1e6,
                cfg.device_prefill_us_per_token / 1e6,
            )
            await self.engine.install_pacer(clock)
            if clock.base_s > 0:
                log.warning("emulated_device_timing", clock=str(clock))
        hello = Hello(self.instance, cfg.role, self.spec.model)
        self.server = TokenServer(
            self.engine,
            hello,
            cfg.host,
            self.port,
            sock=self.sock,
            secret=self.settings.cluster.secret,
            liveness_timeout_s=self.settings.cluster.liveness_timeout_s,
            orphan_grace_s=cfg.orphan_grace_s,
        )
        await self.server.start()
        await self.bus.publish(
            "events",
            Event.now(
                EventKind.WORKER_UP,
                self.instance,
                instance=self.instance,
                data={"role": cfg.role, "address": self.server.address, "model": self.spec.model},
            ),
        )
        log.info("worker_ready", instance=self.instance, role=cfg.role, address=self.server.address)

    def note_predictor(self, checkpoint: str | None) -> None:
        """Record what :func:`start_tap` loaded; a decode worker without a predictor warns."""
        if self.settings.worker.role != "decode":
            return
        self.predictor = checkpoint is not None
        if not self.predictor:
            log.warning(
                "no_length_predictor_loaded",
                hint="reports carry no R-hat, so a scheduler in predicted or bins mode sees "
                "this instance's requests as endless; set predictor.checkpoint (or ship one "
                "in MODEL/predictor/)",
                instance=self.instance,
                model=self.spec.model,
            )

    async def main(self) -> None:
        self.spawn(self._reports(), "reports")
        await self.wait_exit()

    async def _reports(self) -> None:
        assert self.engine is not None and self.server is not None and self.bus is not None
        cfg, sched = self.settings.worker, self.settings.scheduler
        previous: EngineStats | None = None
        timed = StepTimes()  # as of the last report
        step_time_s: float | None = None
        outage = Outage("report_unpublishable", "reports_publishable_again")
        while True:
            await self._next_report(cfg.report_every_steps, cfg.report_interval_s)
            if self.engine.dead:
                raise EngineDead(f"the engine of {self.instance} died; the worker exits")
            stats = self.engine.stats()
            now_timed = await self.engine.step_times()
            measured, pad_share = now_timed.since(timed)
            timed = now_timed
            # An idle instance reports its last known step time (C_mig needs one).
            step_time_s = measured if measured is not None else step_time_s
            self.seq += 1
            report = build_report(
                stats,
                previous,
                instance=self.instance,
                role=cfg.role,
                seq=self.seq,
                ts=time.time(),
                address=self.server.address,
                predictions=await self.engine.predictions(),
                predictor=self.predictor,
                delta=sched.delta,
                horizon=sched.horizon,
                # Set from the stop request on, through the drain: the scheduler
                # then moves requests off it but not onto it (scheduler.view).
                draining=self.exiting,
                step_time_s=step_time_s,
                pad_share=pad_share,
                refused_peers=self.server.refused,
                incarnation=self.incarnation,
            )
            try:
                await self.bus.publish("reports", report)
            except BusUnavailable as exc:
                # Never stop an engine that holds running requests over Redis:
                # this report is dropped, the next one is fresher anyway.
                outage.down(exc)
            else:
                outage.up()
            previous = stats

    async def _next_report(self, steps: int, interval_s: float) -> None:
        """Until ``steps`` decode steps, ``interval_s``, or the drain's start, whichever is first."""
        assert self.engine is not None
        clock = asyncio.ensure_future(self.engine.wait_decode_steps(steps, interval_s))
        now = asyncio.ensure_future(self._report_now.wait())
        try:
            await asyncio.wait({clock, now}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for waiter in (clock, now):
                waiter.cancel()
            await asyncio.gather(clock, now, return_exceptions=True)
        self._report_now.clear()

    async def drain(self) -> None:
        # The first draining report goes out now, not at the next report tick
        # (up to report_interval_s later, while the scheduler could still pick
        # this instance as a migration target).
        self._report_now.set()
        if self.server is not None:
            await self.server.shutdown(self.settings.worker.drain_timeout_s)

    async def cleanup(self) -> None:
        if self.bus is not None:
            try:
                await self.bus.publish(
                    "events",
                    Event.now(EventKind.WORKER_DOWN, self.instance, instance=self.instance),
                    retry=False,
                )
            except Exception as exc:  # Redis gone: the scheduler notices the silence instead
                log.warning("worker_down_unannounced", error=str(exc))
        if self.engine is not None:
            await self.engine.shutdown()
        if self.bus is not None:
            await self.bus.close()
