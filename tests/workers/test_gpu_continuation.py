"""Seeded continuation on vLLM's GPU samplers: benchmarks/gpu_continuation (issue 28).

The script ran on an H200 (docs/measured/gpu-continuation-h200.txt); here it
runs on the CPU (model runner V2's Triton kernels under Triton's interpreter),
its copies of vLLM's code are checked against the installed vLLM, and its CUDA
verdicts are asserted where a GPU is present. The start check must say True
exactly where the skip-ahead reproduces the sampler, and never elsewhere.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from workers.continuation import install

HERE = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_continuation"


def _vllm_source(rel: str) -> str:
    spec = importlib.util.find_spec("vllm")
    assert spec is not None and spec.submodule_search_locations
    return (Path(spec.submodule_search_locations[0]) / rel).read_text()


def _between(text: str, start: str, end: str) -> str:
    return text.split(start, 1)[1].split(end, 1)[0]


def test_the_copies_are_vllms_own_code() -> None:
    sampler = _vllm_source("v1/sample/ops/topk_topp_sampler.py").splitlines(keepends=True)
    copy = (HERE / "vllm_v1_sampler.py").read_text()
    funcs = _between(copy, "lines 473-577, verbatim ---\n", "# --- end of lines 473-577")
    method = _between(copy, "lines 263-284, verbatim ---\n", "    # --- end of lines 263-284")
    assert funcs == "".join(sampler[472:577])
    assert method == "".join(sampler[262:284])
    assert "q[i].exponential_(generator=generator)" in funcs  # the seeded draw

    gumbel = _vllm_source("v1/worker/gpu/sample/gumbel.py")
    copy = (HERE / "vllm_v2_gumbel.py").read_text()
    body = copy.split(
        "# test_gpu_continuation.py checks the rest still equals the installed source.\n"
    )[1]
    ours = "import triton\nimport triton.language as tl  # vLLM: from vllm.triton_utils import tl, triton\n"
    assert body.replace(ours, "from vllm.triton_utils import tl, triton\n") == gumbel


def _verdicts(result: dict[str, Any]) -> None:
    """What must hold on any device."""
    for row in result["v1_states"]:
        assert row["replay_matches"], row  # the control: the sampler's own draw
        # The start check is exactly as strong as the skip: True only where it matches.
        assert row["start_check"] is row["star_skip_matches"], row
    for row in result["v1_tokens"]:
        assert row["replay"]["equal"], row
        assert row["no_skip"]["matching"] == 0, row
        assert row["star_skip"]["equal"] is (row["star_skip"]["matching"] == row["star_skip"]["of"])
    assert result["v1_start_check_before"] is False
    v2 = result["v2_tokens"]
    if isinstance(v2, list):
        assert v2, "no V2 case ran"
        for row in v2:
            assert row["restarted"]["equal"], row
            assert row["pos_off_by_one"]["matching"] == 0, row
            assert row["other_seed"]["matching"] == 0, row


def test_the_script_on_the_cpu(tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run(
        [
            *(sys.executable, "-m", "benchmarks.gpu_continuation.check"),
            *("--device", "cpu", "--quick", "--out", str(out)),
        ],
        cwd=HERE.parents[1],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "V1 tokens after a restart" in proc.stdout
    result = json.loads(out.read_text())
    _verdicts(result)
    # On CPU tensors the native sampler draws a vocabulary's worth a step: one
    # randint is no skip for it, and the check says so.
    assert all(r["star_skip_matches"] is False for r in result["v1_states"])
    assert all(not r["star_skip"]["equal"] for r in result["v1_tokens"])
    if importlib.util.find_spec("triton") is not None:
        assert isinstance(result["v2_tokens"], list), result["v2_tokens"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_script_on_cuda() -> None:
    from benchmarks.gpu_continuation.check import run

    result = run("cuda")
    _verdicts(result)
    limit = result["info"]["one_call_vocab_limit"]
    for row in result["v1_states"]:
        if not row["fp64_gumbel"] and row["vocab"] <= limit:
            assert row["offset_per_step"] == 4 and row["start_check"], row
        if row["offset_per_step"] != 4:
            assert row["start_check"] is False, row
    assert all(r["star_skip"]["equal"] for r in result["v1_tokens"])
    assert isinstance(result["v2_tokens"], list)


def test_install_checks_on_the_runners_device_and_vocabulary() -> None:
    seen: list[tuple[str, int]] = []

    def sampler(
        logits: torch.Tensor, generators: dict[int, torch.Generator], k: Any, p: Any
    ) -> Any:
        seen.append((logits.device.type, logits.shape[-1]))
        for g in generators.values():
            assert g.device == logits.device
            torch.randint(0, 2**31, (1,), generator=g)
        return logits.argmax(-1), None

    batch = SimpleNamespace(vocab_size=151_936, add_request=lambda request: 0)
    runner = SimpleNamespace(
        input_batch=batch,
        device=torch.device("cpu"),
        sampler=SimpleNamespace(topk_topp_sampler=sampler),
        _update_states=lambda *a, **k: None,
    )
    assert install(runner) == {"installed": True, "seeded": True}
    assert seen and set(seen) == {("cpu", 151_936)}


@pytest.mark.engine
async def test_a_cpu_engine_proves_its_skip_at_start() -> None:
    """On a real CPU engine the check, driven with the runner's device and vocabulary, says True."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # import-time deprecations in torch/vLLM
        from star.model import tiny_model_path
        from workers.engine import EngineHandle
        from workers.engine_config import EngineSpec

    spec = EngineSpec(
        model=str(tiny_model_path()), role="decode", max_model_len=1024, kv_cache_space_gib=0.25
    )
    handle = await EngineHandle.start(spec)
    try:
        assert spec.true_continuation
        assert handle.seeded_resume is True
    finally:
        await handle.shutdown()
