"""The pieces of a true continuation, one at a time (docs/design.md §5.4; issue 28).

The seeded skip-ahead against vLLM's own CPU sampler, the install check that
refuses a sampler it does not match, the resume hook of the V1 runner's input
batch, and the pull count of :class:`workers.vllm_ext.StarNixlConnector`. The
whole, on two real engines, is tests/migration/test_continuation.py.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from workers.continuation import RESUME_KEY, _Resumer, skip, skip_matches_sampler

# vLLM's import chain (torch.jit) warns; not this code's.
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def _cpu_sampler(**kwargs: Any) -> Any:
    from vllm.platforms import current_platform
    from vllm.v1.sample.ops.topk_topp_sampler import TopKTopPSampler

    current_platform.import_kernels()  # fused_gumbel_argmax, as an engine has it
    return TopKTopPSampler(**kwargs)


@pytest.mark.parametrize("steps", [0, 1, 5, 300])
def test_the_skip_ahead_is_what_the_cpu_sampler_draws(steps: int) -> None:
    sampler = _cpu_sampler()
    assert sampler.forward.__name__ == "forward_cpu"
    stepped = torch.Generator().manual_seed(99)
    skipped = torch.Generator().manual_seed(99)
    logits = torch.randn(3, 200)
    for _ in range(steps):
        # Row 1 seeded, among unseeded rows, with top-k/top-p: one draw a step still.
        sampler(logits.clone(), {1: stepped}, torch.tensor([50, 50, 50]), torch.tensor([0.9] * 3))
    skip(skipped, steps)
    assert torch.equal(stepped.get_state(), skipped.get_state())
    # ... and the next draws are the same stream.
    assert torch.equal(
        torch.randint(0, 2**31, (4,), generator=stepped),
        torch.randint(0, 2**31, (4,), generator=skipped),
    )


def test_the_install_check_refuses_a_sampler_it_does_not_match() -> None:
    assert skip_matches_sampler(_cpu_sampler())
    # vLLM's fp64 Gumbel path draws a vocabulary's worth of noise a step.
    assert not skip_matches_sampler(_cpu_sampler(use_fp64_gumbel=True))

    def twice(logits: torch.Tensor, generators: dict[int, torch.Generator], k: Any, p: Any) -> Any:
        for g in generators.values():
            torch.randint(0, 2**31, (2,), generator=g)
        return logits.argmax(-1), None

    assert not skip_matches_sampler(twice)

    def broken(*_: Any) -> Any:
        raise RuntimeError("no kernel")

    assert not skip_matches_sampler(broken)


def _request(rid: str, resume: list[int] | None, seed: int | None = None) -> SimpleNamespace:
    generator = torch.Generator().manual_seed(seed) if seed is not None else None
    extra = {RESUME_KEY: resume} if resume else None
    return SimpleNamespace(
        req_id=rid,
        output_token_ids=[],
        generator=generator,
        sampling_params=SimpleNamespace(extra_args=extra),
    )


def _batch() -> SimpleNamespace:
    seen: list[tuple[str, list[int]]] = []

    def add_request(request: Any) -> int:
        seen.append((request.req_id, list(request.output_token_ids)))
        return len(seen) - 1

    return SimpleNamespace(add_request=add_request, seen=seen)


def test_a_resumed_request_enters_the_batch_with_its_outputs_once() -> None:
    batch = _batch()
    resumer = _Resumer(runner=None, seeded=True)
    resumer.wrap(batch)
    resumer.wrap(batch)  # wrapping twice changes nothing
    moved = _request("m", [5, 6, 7], seed=3)
    plain = _request("p", None)
    batch.add_request(moved)
    batch.add_request(plain)
    assert batch.seen == [("m", [5, 6, 7]), ("p", [])]
    expected = torch.Generator().manual_seed(3)
    skip(expected, 3)
    assert torch.equal(moved.generator.get_state(), expected.get_state())
    # Back in the batch (after a preemption, or a step unscheduled): as it is now.
    moved.output_token_ids.append(8)
    batch.add_request(moved)
    assert batch.seen[-1] == ("m", [5, 6, 7, 8])
    assert torch.equal(moved.generator.get_state(), expected.get_state())
    resumer.forget({"m"})
    assert "m" not in resumer.done


def test_without_an_exact_skip_a_seeded_generator_is_left_alone() -> None:
    # The engine then reports seeded requests non-migratable; none is resumed.
    batch = _batch()
    _Resumer(runner=None, seeded=False).wrap(batch)
    moved = _request("m", [5, 6], seed=3)
    batch.add_request(moved)
    assert moved.output_token_ids == [5, 6]
    assert torch.equal(moved.generator.get_state(), torch.Generator().manual_seed(3).get_state())


def test_the_negative_control_switch_turns_the_hook_off() -> None:
    batch = _batch()
    resumer = _Resumer(runner=None, seeded=True)
    resumer.enabled = False
    resumer.wrap(batch)
    moved = _request("m", [5, 6], seed=3)
    batch.add_request(moved)
    assert batch.seen == [("m", [])]


def _connector(threshold: int = 64) -> Any:
    from workers.vllm_ext import StarNixlConnector

    conn = object.__new__(StarNixlConnector)  # only the scheduler side's threshold is read
    conn.connector_scheduler = SimpleNamespace(kv_recompute_threshold=threshold)
    return conn


def _continuation(prompt: int, outputs: int, params: dict[str, Any]) -> SimpleNamespace:
    return SimpleNamespace(
        request_id="r",
        num_tokens=prompt + outputs,
        num_prompt_tokens=prompt,
        kv_transfer_params=params,
        sampling_params=SimpleNamespace(extra_args={RESUME_KEY: list(range(outputs))}),
    )


READBACK = {
    "do_remote_decode": True,
    "remote_block_ids": [[1, 2, 3]],
    "remote_engine_id": "e",
    "remote_request_id": "s",
    "remote_host": "h",
    "remote_port": 1,
}


def test_a_continuation_pulls_every_token_but_the_last() -> None:
    conn = _connector()
    # The source holds P + N - 1 tokens; the prompt alone (vLLM's rule) would be 180.
    params = {**READBACK, "remote_num_tokens": 180 + 100 - 1}
    assert conn.get_num_new_matched_tokens(_continuation(180, 100, params), 0) == (279, True)
    # A local prefix-cache hit is not pulled again.
    assert conn.get_num_new_matched_tokens(_continuation(180, 100, params), 160) == (119, True)
    # Under kv_recompute_threshold: recomputed.
    assert conn.get_num_new_matched_tokens(_continuation(180, 100, params), 240) == (0, False)
    assert _connector(0).get_num_new_matched_tokens(_continuation(180, 100, params), 240) == (
        39,
        True,
    )
    # Not a complete readback (a recompute, or a failed pull already tried): nothing pulled.
    assert conn.get_num_new_matched_tokens(_continuation(180, 100, {}), 0) == (0, False)
    tried = {**params, "_remote_blocks_processed": True}
    assert conn.get_num_new_matched_tokens(_continuation(180, 100, tried), 0) == (0, False)
