"""A decode worker without a length predictor says so: a warning at start-up and in every report.

The real :class:`WorkerService` and the real :func:`workers.tap_client.start_tap` on a
model directory with no ``predictor/``, with the stand-in engine of
tests/workers/test_dead_engine.py instead of vLLM.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from star.bus import Bus
from tests.redis_server import RedisServer
from tests.workers.test_dead_engine import (
    WITHIN_S,
    DyingEngine,
    IdleServer,
    WorkerService,
    reports,
    serving,
    worker_settings,
)
from workers.tap_client import start_tap


class TaplessEngine(DyingEngine):
    def __init__(self, role: str, model: str) -> None:
        super().__init__()
        self.role = role
        self.model = model


class Worker(WorkerService):
    """The real service on a stand-in engine; the tap is started as in the real start-up."""

    async def startup(self) -> None:
        self.bus = Bus.from_settings(self.settings.redis, self.settings.bus)
        engine = TaplessEngine(self.settings.worker.role, self.spec.model)
        self.engine = engine  # type: ignore[assignment]
        self.server = IdleServer()  # type: ignore[assignment]
        pred = self.settings.predictor
        self.note_predictor(await start_tap(engine, pred.every_k, pred.checkpoint))


@pytest.mark.parametrize(("role", "said"), [("decode", False), ("prefill", None)])
async def test_a_worker_without_a_predictor_warns_and_reports_it(
    redis_server: RedisServer, tmp_path: Path, role: str, said: bool | None
) -> None:
    worker = Worker(
        worker_settings(
            redis_server,
            role=role,
            instance="w-x",
            model=str(tmp_path),  # a model directory without predictor/
            report_interval_s=0.05,
            drain_timeout_s=1.0,
        )
    )
    with capture_logs() as logs:
        async with serving(worker) as (_task, bus):
            async with asyncio.timeout(WITHIN_S):
                while len(got := await reports(bus)) < 2:  # noqa: ASYNC110 (state in Redis)
                    await asyncio.sleep(0.02)
    assert {r.predictor for r in got} == {said}
    warned = [e for e in logs if str(e["event"]).startswith("no_length_predictor_loaded")]
    if said is False:
        assert [(e["log_level"], e["instance"]) for e in warned] == [("warning", "w-x")]
    else:
        assert warned == []  # a prefill worker never has one
