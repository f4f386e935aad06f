"""The shipped model through vLLM's normal loading (slow: starts a real engine)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

# The subprocess may take up to its own 600 s limit on a cold, loaded machine.
pytestmark = [pytest.mark.engine, pytest.mark.timeout(900)]


def test_vllm_loads_the_tiny_model_and_matches_transformers() -> None:
    # A subprocess: vLLM spawns its engine core and configures logging and
    # signal handling process-wide, which a pytest process should not inherit.
    # Eager: the same loading and forward pass without minutes of torch.compile
    # (the workers run eager on CPU too). Its own session, so that a timeout
    # also stops vLLM's engine-core child instead of orphaning it.
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}
    cmd = [sys.executable, "-m", "star.model.vllm_check", "--prompts", "2", "--samples", "2", "--eager"]
    with subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, start_new_session=True
    ) as proc:
        try:
            out, err = proc.communicate(timeout=600)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
            pytest.fail("vllm_check did not finish in 600 s:\n" + out + err[-4000:])
    assert proc.returncode == 0, out + err[-4000:]
    assert "equal to transformers' greedy output: 20/20" in out
    assert "LLM.chat == LLM.generate on the templated text: 20/20" in out
