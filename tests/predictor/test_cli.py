"""``star predictor train|eval`` and ``star bench predictor`` on small synthetic data; the tap client."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from star.cli.main import main
from star.predictor.dataset import DataDir
from star.predictor.model import load_checkpoint
from tests.predictor.helpers import synthetic
from workers.tap_client import TapClient


@pytest.fixture
def data_dir(tmp_path: Path) -> Path:
    s = synthetic(requests=80)
    d = DataDir(tmp_path / "data")
    d.start(
        {
            "model": "synthetic-test",
            "hidden_size": s.dim,
            "workload": "synthetic",
            "seed": 0,
            "every": 20,
        }
    )
    d.append(s, 80, [])
    return d.root


@pytest.fixture(autouse=True)
def _restore_threads() -> Any:
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_train_then_eval(data_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = [
        "predictor",
        "train",
        str(data_dir),
        "--no-search",
        "--hidden",
        "16",
        "--max-epochs",
        "4",
        "--quiet",
    ]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "16 lr=0.001 bs=256" in out and "wrote" in out
    ckpt = load_checkpoint(data_dir / "predictor")
    assert ckpt.config.hidden_sizes == (16,)
    assert ckpt.metadata["model"] == "synthetic-test"
    assert ckpt.metadata["data"]["hash"] == DataDir(data_dir).data_hash()
    assert set(ckpt.metadata["metrics"]) == {
        "mlp-fused",
        "mlp",
        "constant",
        "prompt-only",
        "bins:6",
        "bins:4",
        "bins:2",
    }

    assert main(["predictor", "eval", str(data_dir), "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert rows and all(
        set(r) == {"predictor", "bucket", "mae", "nmae", "kendall_tau", "samples"} for r in rows
    )
    overall = {r["predictor"]: r for r in rows if r["bucket"] == "all"}
    assert overall["mlp"]["samples"] == overall["constant"]["samples"] > 0

    png = data_dir / "eval.png"
    assert main(["predictor", "eval", str(data_dir), "--plot", str(png)]) == 0
    table = capsys.readouterr().out
    assert "progress 0" in table and "prompt-only" in table
    assert png.stat().st_size > 1000


def test_train_widths_come_from_the_settings_unless_given(
    data_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    base = ["predictor", "train", str(data_dir), "--no-search", "--max-epochs", "2", "--quiet"]
    assert main([*base, "--set", "predictor.hidden_sizes=8,4"]) == 0
    assert load_checkpoint(data_dir / "predictor").config.hidden_sizes == (8, 4)
    assert main([*base, "--set", "predictor.hidden_sizes=8,4", "--hidden", "6"]) == 0
    assert load_checkpoint(data_dir / "predictor").config.hidden_sizes == (6,)
    capsys.readouterr()
    assert main([*base, "--set", "predictor.hidden_sizes=0"]) == 2
    assert "predictor.hidden_sizes" in capsys.readouterr().err


def test_eval_without_checkpoint_or_data_fails_clearly(
    tmp_path: Path, data_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["predictor", "eval", str(data_dir)]) == 2
    assert "no predictor checkpoint" in capsys.readouterr().err
    assert main(["predictor", "train", str(tmp_path / "none"), "--quiet"]) == 2
    assert "star predictor collect" in capsys.readouterr().err


def test_collect_refuses_a_missing_workload_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert (
        main(
            [
                "predictor",
                "collect",
                "--out",
                str(tmp_path),
                "--workload",
                str(tmp_path / "x.jsonl"),
            ]
        )
        == 2
    )
    assert "neither 'synthetic' nor a file" in capsys.readouterr().err


def test_bench_predictor_prints_a_table(capsys: pytest.CaptureFixture[str]) -> None:
    assert (
        main(
            [
                "bench",
                "predictor",
                "--dims",
                "16",
                "--batches",
                "1,10",
                "--repeats",
                "3",
                "--no-gpu",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "median ms" in out and "paper" in out
    assert (
        main(
            [
                "bench",
                "predictor",
                "--dims",
                "16",
                "--batches",
                "1",
                "--repeats",
                "2",
                "--json",
                "--no-gpu",
            ]
        )
        == 0
    )
    rows = json.loads(capsys.readouterr().out)["mlp"]
    assert [(r["device"], r["dim"], r["batch"]) for r in rows] == [("cpu", 16, 1)]
    assert main(["bench", "predictor", "--dims", "0"]) == 2


class FakeLLM:
    """Answers the tap's collective_rpc calls as one vLLM worker would."""

    def __init__(self, requests: dict[str, list[float]]) -> None:
        self.requests = requests
        self.calls: list[str] = []

    async def collective_rpc(self, method: str, args: tuple[Any, ...] = ()) -> list[dict[str, Any]]:
        self.calls.append(method)
        if method == "star_tap_install":
            return [{"hidden_size": 128, "predictor": bool(args[1])}]
        return [
            {"requests": self.requests, "predict_s": 0.004, "batches": 4, "rows": 10, "steps": 80}
        ]


async def test_tap_client_ages_predictions_by_tokens_since() -> None:
    llm = FakeLLM(
        {"a-abcdefgh": [100.0, 40, 2.0, 280.0], "b-12345678": [5.0, 10], "gone-aaaaaaaa": [9.0, 1]}
    )
    client = TapClient(llm)
    assert await client.predictions({"a": 1}) == {}  # not installed: no RPC
    assert llm.calls == []
    assert await client.install(20, "ckpt") == 128
    got = await client.predictions({"a": 70, "b": 30})
    # a: predicted 100 at 40 generated, 30 tokens since -> 70; b: floored at one token.
    assert got == {"a": 70.0, "b": 1.0}
    # The fusion state a released request takes along, by the caller's id.
    assert client.fusion == {"a": [2.0, 280.0]}
    assert client.timing.mean_batch_s == pytest.approx(0.001)


async def test_tap_client_without_a_predictor_asks_nothing() -> None:
    llm = FakeLLM({})
    client = TapClient(llm)
    await client.install(20, "")
    assert await client.predictions({"a": 1}) == {}
    assert llm.calls == ["star_tap_install"]
