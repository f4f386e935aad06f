"""The chaos suite's resuming client (benchmarks.chaos.load): cut, it resumes on the next proxy.

No fleet: a real TokenServer over the scripted engine and two real proxies
(ProxyApp + ClusterBackend). Proxy A stops mid-stream the way SIGTERM's drain
ends (its streams handed to the worker); the client resumes on B and its
text is the reference, counted as one resume.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest

from benchmarks.chaos import load
from benchmarks.chaos.fleet import MODEL
from proxy.app import ProxyApp, create_server
from proxy.cluster import ClusterBackend, Directory
from proxy.http import HttpServer
from proxy.tokenizer import ModelCard
from proxy.upstream import WorkerPool
from star.settings import ProxySettings
from star.wire import Hello
from tests.proxy.fakes import build_tokenizer, write_model_dir
from tests.reports import report
from tests.workers.fakes import FakeEngine
from workers.server import TokenServer

SECRET = "chaos-secret"
FIRST = 36  # "A" in the test tokenizer
TOKENS = 60


@pytest.fixture
def card(tmp_path: Path) -> ModelCard:
    return ModelCard.load(write_model_dir(tmp_path / "m", build_tokenizer()), name=MODEL)


async def _proxy(srv: TokenServer, card: ModelCard) -> tuple[ProxyApp, HttpServer, WorkerPool]:
    bus = SimpleNamespace(keys=SimpleNamespace(reports="t:reports"))  # only named in errors
    directory = Directory(bus, staleness_s=60)  # type: ignore[arg-type]
    directory._reports["decode-0"] = (time.monotonic(), report("decode-0", address=srv.address))
    pool = WorkerPool()
    settings = ProxySettings(host="127.0.0.1", port=0)
    app = ProxyApp(
        ClusterBackend(directory, pool, "current-load", "proxy"), [card], settings, secret=SECRET
    )
    http = create_server(app, settings)
    await http.start()
    return app, http, pool


@pytest.fixture
async def worker() -> AsyncIterator[tuple[TokenServer, FakeEngine]]:
    engine = FakeEngine(step_s=0.02, first_id=FIRST)
    srv = TokenServer(
        engine, Hello(instance="decode-0", role="decode", model=MODEL), orphan_grace_s=10
    )
    await srv.start()
    yield srv, engine
    await srv.shutdown(drain_timeout=0.1)


async def test_a_cut_client_resumes_on_the_next_proxy(
    worker: tuple[TokenServer, FakeEngine], card: ModelCard
) -> None:
    srv, engine = worker
    a_app, a_http, a_pool = await _proxy(srv, card)
    b_app, b_http, b_pool = await _proxy(srv, card)
    urls = [f"http://127.0.0.1:{h.port}" for h in (a_http, b_http)]
    try:
        async with httpx.AsyncClient(timeout=30) as client:
            running = asyncio.create_task(
                load.stream(client, urls[0], "a prompt", TOKENS, resume=[urls[1], urls[0]])
            )
            await asyncio.sleep(0.5)  # some tokens out
            assert engine.live

            def hand_off() -> None:
                a_app.backend.handing_off = True  # type: ignore[attr-defined]

            await a_http.shutdown(timeout_s=0.0, on_timeout=hand_off)  # proxy A stops
            await a_pool.close()
            got = await running
        letters = "".join(card.tokenizer.decode([FIRST + i]) for i in range(TOKENS))
        assert got.outcome == "ok" and got.resumes == 1
        assert got.text == letters
        assert engine.started == [got.request_id] and engine.aborted == []
    finally:
        for app, http, pool in ((a_app, a_http, a_pool), (b_app, b_http, b_pool)):
            await http.shutdown(timeout_s=0.5)
            app.close()
            await pool.close()
