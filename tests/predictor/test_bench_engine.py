"""``star bench predictor --engine`` as a user runs it: a real engine, its JSON piped on."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.engine, pytest.mark.timeout(600)]


def test_engine_overhead_json_is_alone_on_stdout_and_the_exit_is_clean() -> None:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "star.cli.main",
            "bench",
            "predictor",
            "--engine",
            "--engine-requests",
            "4",
            "--dims",
            "16",
            "--batches",
            "1",
            "--repeats",
            "2",
            "--no-gpu",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=540,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    # vLLM, NIXL and structlog log to stdout; here they must not (the JSON parses).
    engine = json.loads(proc.stdout)["engine"]
    assert "engine_started" in proc.stderr
    assert engine["requests"] == 4 and engine["every"] == 20
    assert engine["steps"] > 20 and engine["rounds"] >= 1 and engine["mean_rows"] >= 1
    assert 0 < engine["predict_s"] < engine["step_s"]
    assert 0 < engine["overhead_pct"] < 100
    assert 0 < engine["tap_cpu_s"] < engine["step_cpu_s"]
    # vLLM's AsyncLLM.__del__ used to fail at interpreter exit after a request had run.
    assert "Exception ignored" not in proc.stderr, proc.stderr[-3000:]
