"""The shipped model through vLLM's normal loading (slow: starts a real engine)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

# The subprocess may take up to its own 600 s limit on a cold, loaded machine.
pytestmark = [pytest.mark.engine, pytest.mark.timeout(900)]


def test_vllm_loads_the_tiny_model_and_matches_transformers() -> None:
    # A subprocess: vLLM spawns its engine core and configures logging and
    # signal handling process-wide, which a pytest process should not inherit.
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "star.model.vllm_check", "--prompts", "2", "--samples", "2"],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
        check=False,
    )
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr[-4000:]
    assert "equal to transformers' greedy output: 20/20" in out
    assert "LLM.chat == LLM.generate on the templated text: 20/20" in out
