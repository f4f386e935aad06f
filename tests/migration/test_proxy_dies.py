"""A migration in flight when its proxy dies: the stream ends exactly on another proxy (issue 26).

Two proxies of their own (``star proxy`` processes, the fleet's secret, so
each takes over the other's streams) in front of the package fleet's
workers. A greedy completion streams through proxy A; a decision moves it
to the other decode instance; A is SIGKILLed while the move is under way,
at a phase pinned by pausing processes (SIGSTOP), never by timing:

* ``target``: the source has released and A has opened the target's leg,
  whose engine stands still (it cannot pull): the target holds the request
  as an orphan when A's connection drops;
* ``source``: A stands still once it sent the Release; the source releases,
  its Handoff goes nowhere; then A dies, and only the source's record of
  the release says where the request is.

The client resumes on proxy B with the last event id it got: the text and
usage must equal an unbroken greedy run's, and every decode instance's KV
goes back to idle.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from proxy import sse
from star.bus import Bus
from star.fleet import LocalCluster, manual_decision
from star.wire import EventKind
from tests.e2e.streams import SSE
from tests.migration.conftest import (
    MODEL,
    engine_paused,
    release_to,
    signal_all,
    source_paused,
    wait_event,
    wait_kv_idle,
)
from tests.migration.test_fleet import other, prompt
from tests.migration.test_fleet import pytestmark as fleet_marks
from tests.procs import ProxyProcess, proxy_process
from tests.proxy.test_resume import _read

pytestmark = fleet_marks

TOKENS = 300


@pytest.fixture
def proxies(fleet: LocalCluster, tmp_path: Path) -> Iterator[tuple[ProxyProcess, ProxyProcess]]:
    env = {**fleet.env, "STAR_LOG_FORMAT": "json"}
    with (
        proxy_process(env, tmp_path / "a.log") as a,
        proxy_process(env, tmp_path / "b.log") as b,
    ):
        for p in (a, b):
            p.wait(lambda p=p: len(p.lists("decode")) == 2, "both decode", 300)  # type: ignore[misc]
        yield a, b


def body(n: int) -> dict[str, Any]:
    return {
        "model": MODEL,
        "prompt": prompt(n),
        "max_tokens": TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


def text_of(events: list[sse.Event]) -> str:
    docs = [json.loads(e.data) for e in events if e.data != sse.DONE_DATA]
    return "".join(c.get("text") or "" for d in docs for c in d.get("choices") or [])


def usage_of(events: list[sse.Event]) -> dict[str, Any] | None:
    docs = [json.loads(e.data) for e in events if e.data != sse.DONE_DATA]
    return next((d["usage"] for d in docs if d.get("usage")), None)


async def source_released(bus: Bus, source: str, request: str, since: float) -> None:
    """A report of ``source`` newer than ``since`` no longer runs ``request`` (it released it)."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        r = (await bus.latest_reports()).get(source)
        if r is not None and r.ts > since and not any(q.id.startswith(request) for q in r.requests):
            return
        await asyncio.sleep(0.1)
    raise AssertionError(f"{source} still runs {request}")


@pytest.mark.parametrize("phase", ["target", "source"])
async def test_a_move_under_way_when_its_proxy_dies_ends_exactly_on_another(
    fleet: LocalCluster, bus: Bus, proxies: tuple[ProxyProcess, ProxyProcess], phase: str
) -> None:
    a, b = proxies
    n = 40 if phase == "target" else 41
    async with httpx.AsyncClient(timeout=300, headers=SSE) as client:
        async with client.stream("POST", f"{b.url}/v1/completions", json=body(n)) as resp:
            whole = await _read(resp)
        got: list[sse.Event] = []
        first = asyncio.Event()

        async def stream() -> None:
            with contextlib.suppress(httpx.HTTPError):
                async with client.stream("POST", f"{a.url}/v1/completions", json=body(n)) as r:
                    decoder = sse.SSEDecoder()
                    async for chunk in r.aiter_raw():
                        got.extend(decoder.feed(chunk))
                        if got:
                            first.set()

        reader = asyncio.create_task(stream())
        try:
            await asyncio.wait_for(first.wait(), 120)
            request = json.loads(got[0].data)["id"]
            async with source_paused(fleet, bus, request) as (source, pids):
                target = other(source)
                with contextlib.ExitStack() as stack:
                    if phase == "target":
                        stack.enter_context(engine_paused(fleet, target))
                        await release_to(
                            bus, request, source, target, lambda: signal_all(pids, signal.SIGCONT)
                        )
                        # A opened the target's leg as it published the release (one step of
                        # its loop); the target's engine stands still, so it cannot have ended.
                        await asyncio.sleep(0.5)
                        os.killpg(a.proc.pid, signal.SIGKILL)
                    else:
                        await bus.publish("decisions", manual_decision(request, source, target))
                        await wait_event(
                            bus, request, lambda e: e.event is EventKind.MIGRATING, "migrating"
                        )
                        os.killpg(a.proc.pid, signal.SIGSTOP)  # the Handoff will wait unread
                        since = time.time()
                        signal_all(pids, signal.SIGCONT)
                        await source_released(bus, source, request, since)
                        os.killpg(a.proc.pid, signal.SIGKILL)
            a.proc.wait(30)
            await asyncio.wait_for(reader, 60)
        finally:
            reader.cancel()
            await asyncio.gather(reader, return_exceptions=True)
        cut = [e for e in got if e.id]
        assert cut and cut[-1].data != sse.DONE_DATA, "the stream ended before its proxy died"
        async with client.stream("GET", f"{b.url}/v1/streams/{cut[-1].id}") as resp:
            assert resp.status_code == 200, (await resp.aread()).decode()
            rest = await _read(resp)
    assert rest[-1].data == sse.DONE_DATA
    assert text_of(cut + rest) == text_of(whole)
    assert usage_of(rest) == usage_of(whole)
    assert usage_of(whole)["completion_tokens"] == TOKENS  # type: ignore[index]
    # B took it over where the phase left it: the target's live leg, or the source's release.
    adopted = [
        json.loads(line)
        for line in b.log.read_text().splitlines()
        if '"stream_adopted"' in line and request in line
    ]
    assert len(adopted) == 1, adopted
    assert (adopted[0]["instance"], adopted[0]["released"]) == (
        (target, False) if phase == "target" else (source, True)
    )
    await wait_kv_idle(bus)
