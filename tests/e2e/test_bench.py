"""Load generators against the real cluster: ``star bench serve`` and vLLM's own client."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from star.fleet import LocalCluster
from star.model import tiny_model_path

# Engine starts share the first test's time limit: generous on a loaded 2-core host.
pytestmark = [pytest.mark.engine, pytest.mark.timeout(900)]


def test_star_bench_serve_reports_latencies_and_goodput(cluster: LocalCluster) -> None:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "star.cli.main",
            "bench",
            "serve",
            "--url",
            cluster.url,
            "--num-prompts",
            "5",
            "--rate",
            "5",
            "--sizes",
            "tiny",
            "--max-tokens",
            "64",
            "--seed",
            "1",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=600,  # item limit 900 s; vLLM imports alone take minutes under load
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    out = json.loads(proc.stdout)
    assert (out["completed"], out["failed"]) == (5, 0), out["errors"]
    assert out["output_tokens"] >= 5 and out["prompt_tokens"] >= 5 * 10
    ttft, e2e = out["ttft_ms"], out["e2e_ms"]
    assert 0 < ttft["median"] <= e2e["median"] and ttft["p99"] <= e2e["p99"]
    assert out["tpot_ms"]["mean"] > 0
    assert 0 <= out["goodput"] <= out["request_throughput"]


def test_vllm_bench_serve_client_against_the_proxy(cluster: LocalCluster, tmp_path: Path) -> None:
    """vLLM's benchmark client (``vllm bench serve --backend openai``) against the proxy."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks.vllm_client",  # = `vllm bench serve` (see its docstring)
            "--backend",
            "openai",
            "--base-url",
            cluster.url,
            "--endpoint",
            "/v1/completions",
            "--model",
            "star-tiny",
            "--tokenizer",
            str(tiny_model_path()),
            "--dataset-name",
            "random",
            "--random-input-len",
            "32",
            "--random-output-len",
            "16",
            "--num-prompts",
            "8",
            "--request-rate",
            "4",
            "--ignore-eos",
            "--seed",
            "0",
            "--disable-tqdm",
            "--save-result",
            "--result-dir",
            str(tmp_path),
            "--result-filename",
            "r.json",
        ],
        capture_output=True,
        text=True,
        timeout=600,  # item limit 900 s; vLLM imports alone take minutes under load
        env=env,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((tmp_path / "r.json").read_text())
    assert result["completed"] == 8, result.get("errors")
    assert result["total_output_tokens"] == 8 * 16  # ignore_eos: exactly the asked lengths
    assert result["mean_ttft_ms"] > 0
    # The cluster still serves afterwards (the lost attempt saw 503s here).
    health = httpx.get(f"{cluster.url}/health", timeout=10).json()
    assert health["ok"] and len(health["decode"]) == 2
