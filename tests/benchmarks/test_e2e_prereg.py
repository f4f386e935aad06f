"""Pre-registration of an e2e sweep (benchmarks/e2e/prereg.py): the simulator's prediction
of every cell, the knee its rule picks, written before anything runs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from benchmarks.e2e import prereg
from benchmarks.e2e.compare import comparison_table
from benchmarks.e2e.report import Cell
from benchmarks.e2e.workload import Workload


def _predict(cells: list[Cell], workload: Workload) -> list[dict[str, Any]]:
    return prereg.predict(
        cells,
        workload,
        lambda prompt: 30,
        num_prompts=30,
        kv_requests=2.0,
        max_model_len=512,
        prefill=1,
        decode=3,
        bytes_per_token=1024,
    )


def test_every_cell_gets_the_simulators_prediction() -> None:
    cells = [Cell("device", m, r, 1) for r in (2.0, 8.0) for m in ("no-migration", "predicted")]
    rows = _predict(cells, Workload("replay", cap=256))
    assert [(r["mode"], r["rate"]) for r in rows] == [(c.mode, c.rate) for c in cells]
    for r in rows:
        assert r["p99_tpot_ms"] >= 8.0  # at least the device's base step
        assert 0.0 <= r["slo_attainment"] <= 1.0
    light, heavy = rows[0], rows[2]  # no-migration at 2 and at 8 req/s
    assert heavy["p99_tpot_ms"] > light["p99_tpot_ms"]


@pytest.mark.parametrize(
    ("cell", "workload", "error"),
    [
        (Cell("device", "predicted", 2.0, 1), Workload("task"), "natural output lengths"),
        (Cell("memory", "predicted", 2.0, 1), Workload("replay", cap=256), "CPU's own step"),
    ],
)
def test_what_cannot_be_predicted_is_refused(cell: Cell, workload: Workload, error: str) -> None:
    with pytest.raises(prereg.PredictionError, match=error):
        _predict([cell], workload)


def _cell(regime: str, rate: float, seed: int, attainment: float) -> dict[str, Any]:
    return {"regime": regime, "mode": "no-migration", "rate": rate, "seed": seed,
            "p99_tpot_ms": 20.0, "slo_attainment": attainment}  # fmt: skip


def test_the_knee_is_the_lowest_rate_below_the_attainment_target() -> None:
    cells = [
        _cell("device", 2.0, 1, 0.99), _cell("device", 2.0, 2, 0.97),
        _cell("device", 3.0, 1, 0.96), _cell("device", 3.0, 2, 0.93),  # mean 0.945
        _cell("device", 4.0, 1, 0.80), _cell("device", 4.0, 2, 0.70),
        _cell("memory", 6.0, 1, 0.99), _cell("memory", 8.0, 1, 0.98),
    ]  # fmt: skip
    assert prereg.knees(cells) == {"device": 3.0, "memory": None}


def test_a_registration_records_date_commit_design_and_knee(tmp_path: Path) -> None:
    path = tmp_path / "pred.json"
    cells = [_cell("device", 2.0, 1, 0.9)]
    doc = prereg.write(path, cells, {"workload": "replay"})
    again = prereg.load(path)
    assert again == json.loads(path.read_text()) == doc
    assert doc["knee"] == {"device": 2.0} and doc["knee_rule"] == prereg.KNEE_RULE
    assert doc["registered"].startswith("20") and doc["design"] == {"workload": "replay"}
    # Cells name their fleet shape; one written without it has the design's (default 1P+3D).
    assert prereg.predicted_p99(doc) == {("device", "1P+3D", 2.0, "no-migration"): 20.0}
    doc["cells"][0]["cluster"] = "2P+6D"
    assert prereg.predicted_p99(doc) == {("device", "2P+6D", 2.0, "no-migration"): 20.0}
    # Beside a sweep that has run some seeds, the mean over those seeds only.
    doc["cells"] += [_cell("device", 2.0, 2, 0.5) | {"p99_tpot_ms": 80.0, "cluster": "2P+6D"}]
    key = ("device", "2P+6D", 2.0, "no-migration")
    assert prereg.predicted_p99(doc)[key] == 50.0
    assert prereg.predicted_p99(doc, lambda k: [2] if k == key else [])[key] == 80.0
    assert prereg.predicted_p99(doc, lambda k: [3]) == {}
    (tmp_path / "other.json").write_text("{}")
    with pytest.raises(prereg.PredictionError, match="not a pre-registration"):
        prereg.load(tmp_path / "other.json")


def test_the_comparison_shows_the_prediction_beside_the_result() -> None:
    row = {"regime": "device", "rate": 3.0, "mode": "predicted", "seeds": 1, "requests": 80,
           "length_match": 1.0, "p99_tpot_ms": 30.0, "p99_tpot_ratio": 0.5,
           "predicted_p99_tpot_ms": 27.5, "preemptions": 0, "migrations_completed": 1,
           "decisions": 1}  # fmt: skip
    assert "| 30.0 | 0.50 | 27.5 |" in comparison_table([row])


def test_star_bench_e2e_predict_writes_the_file_and_names_the_knee(tmp_path: Path) -> None:
    path = tmp_path / "pred.json"
    done = subprocess.run(
        [sys.executable, "-m", "star.cli.main", "bench", "e2e", "--regimes", "device",
         "--workload", "replay", "--cap", "256", "--max-model-len", "512",
         "--modes", "no-migration,predicted", "--rates", "1,12", "--seeds", "1",
         "--num-prompts", "40", "--predict", str(path)],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    doc = prereg.load(path)
    assert len(doc["cells"]) == 4 and doc["design"]["num_prompts"] == 40
    assert f"knee of device by the rule: {doc['knee']['device']}" in done.stdout
    refused = subprocess.run(
        [sys.executable, "-m", "star.cli.main", "bench", "e2e", "--workload", "task",
         "--regimes", "device", "--predict", str(tmp_path / "no.json")],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert refused.returncode == 2 and "natural output lengths" in refused.stderr
    assert not (tmp_path / "no.json").exists()
