"""`star simulate`, the sweep runner and `python -m benchmarks.simulator`."""

from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import simulator as bench
from star.cli.main import main
from star.cli.simulate import _apply_settings, build_base, register
from star.planner.types import PlannerParams
from star.sim import ROW_KEYS, SimConfig, simulate
from star.sim.sweep import sweep

TIMES = ("wall_seconds", "cpu_seconds")


def test_json_rows_have_the_documented_keys(capsys: pytest.CaptureFixture[str]) -> None:
    status = main(
        [
            "simulate",
            "--instances",
            "4,6",
            "--modes",
            "no-migration,predicted",
            "--seeds",
            "1",
            "--duration",
            "60",
            "--jobs",
            "1",
            "--json",
            "--no-progress",
        ]
    )
    assert status == 0
    rows = json.loads(capsys.readouterr().out)
    assert len(rows) == 4
    assert all(list(r) == list(ROW_KEYS) for r in rows)
    assert {(r["mode"], r["instances"]) for r in rows} == {
        (m, n) for m in ("no-migration", "predicted") for n in (4, 6)
    }
    assert all(r["sim_seconds"] == 60 and r["wall_seconds"] > 0 for r in rows)


def test_out_writes_results_tables_and_summary(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    status = main(
        [
            "simulate",
            "--instances",
            "4",
            "--modes",
            "current,predicted",
            "--seeds",
            "1,2",
            "--duration",
            "60",
            "--jobs",
            "1",
            "--no-progress",
            "--tables",
            "bins,interval",
            "--table-instances",
            "4",
            "--set",
            "planner.theta=0.2",
            "--set",
            "tick_s=2",
            "--out",
            str(tmp_path),
        ]
    )
    assert status == 0
    printed = capsys.readouterr().out
    assert "Table 4 (bins)" in printed and "Table 5 (prediction interval)" in printed
    with (tmp_path / "results.csv").open() as fh:
        rows = list(csv.DictReader(fh))
    settings = {r["setting"] for r in rows}
    assert "sweep" in settings and "bins:bins:2" in settings and "interval:k=100" in settings
    assert len(json.loads((tmp_path / "results.json").read_text())) == len(rows)
    assert "| 4 | predicted |" in (tmp_path / "summary.md").read_text()


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--modes", "bogus"], "unknown mode 'bogus'"),
        (["--instances", "x"], "expected comma-separated integers"),
        (["--set", "nope=1"], "unknown simulator field"),
        (["--set", "planner.theta=abc"], "planner.theta='abc': expected a number"),
        (["--tables", "other"], "expected bins, interval"),
        (["--workload", "/no/such.json"], "neither a file nor one of"),
        (["--set", "planner.max_migrations=lots"], 'expected "auto" or an integer'),
        (["--set", "planner.max_migrations=0"], 'must be "auto" or an integer >= 1'),
        (["--set", "migration_latency_s=-0.5"], "must be >= 0"),
    ],
)
def test_bad_arguments_fail_with_one_line(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["simulate", "--duration", "10", "--jobs", "1", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_max_migrations_auto_passes_through_to_the_planner() -> None:
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    args = parser.parse_args(["simulate", "--max-migrations", "auto", "--set", "planner.theta=0.2"])
    _apply_settings(args)
    assert build_base(args).planner_params().max_migrations == "auto"
    args = parser.parse_args(["simulate", "--set", "planner.max_migrations=3"])
    _apply_settings(args)
    assert build_base(args).planner_params().max_migrations == 3
    # Several moves per tick in the simulator, counted per finished request.
    base = SimConfig(decode_instances=12, duration_s=300.0, mode="current", seed=1)
    one = simulate(dataclasses.replace(base, planner=PlannerParams(max_migrations=1))).row
    auto = simulate(base).row
    assert auto["migrations"] > one["migrations"] > 0
    assert auto["migrations_per_finished"] == auto["migrations"] / auto["finished"]


def test_pool_runs_match_in_process_runs() -> None:
    configs = [
        SimConfig(decode_instances=4, duration_s=120.0, mode=m, seed=1)
        for m in ("no-migration", "predicted", "oracle")
    ]
    here = sweep(configs, jobs=1, progress=False)
    pooled = sweep(configs, jobs=2, progress=False)
    for a, b in zip(here, pooled, strict=True):
        assert {k: v for k, v in a.row.items() if k not in TIMES} == {
            k: v for k, v in b.row.items() if k not in TIMES
        }


def test_bench_prints_speed_per_size(capsys: pytest.CaptureFixture[str]) -> None:
    assert (
        bench.main(["--sizes", "4,8", "--modes", "no-migration", "--duration", "60", "--json"]) == 0
    )
    rows = json.loads(capsys.readouterr().out)
    assert [r["instances"] for r in rows] == [4, 8]
    assert all(r["sim_per_wall"] > 1 for r in rows)


def test_bench_runs_as_a_module() -> None:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks.simulator",
            "--sizes",
            "4",
            "--modes",
            "no-migration",
            "--duration",
            "30",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    assert "sim s / wall s" in out.stdout
