"""`star model train-tiny` end to end on a few steps."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from star.cli.main import main
from star.model.build import BUILD_INFO
from star.model.export import weights_digest


def test_train_tiny_writes_a_loadable_model_directory(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "tiny"
    assert (
        main(["model", "train-tiny", "--out", str(out), "--steps", "3", "--quiet", "--no-check"])
        == 0
    )
    printed = capsys.readouterr().out
    assert "config differs from the shipped model's: not compared" in printed
    info = json.loads((out / BUILD_INFO).read_text())
    assert info["config"]["steps"] == 3
    assert info["weights_sha256"] == weights_digest(out)
    assert {p.name for p in out.iterdir()} >= {"config.json", "tokenizer.json", "model.safetensors"}


def test_train_tiny_rejects_bad_steps(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["model", "train-tiny", "--steps", "0"]) == 2
    assert "--steps" in capsys.readouterr().err
