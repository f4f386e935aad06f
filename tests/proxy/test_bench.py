"""The proxy benchmark runs end to end (tiny sizes; the numbers are not checked)."""

from __future__ import annotations

import argparse
import json

import pytest

from benchmarks import proxy as bench


def test_benchmark_runs_and_reports_rows(capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser()
    bench.configure(parser)
    args = parser.parse_args(
        ["--streams", "1,4", "--tokens", "200", "--seconds", "0.2", "--interval-ms", "20", "--json"]
    )
    assert bench.run(args) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["streams"] for r in rows] == [1, 4]
    assert [r["tokens"] for r in rows] == [200, 200]
    assert all(r["lat_tokens"] >= r["streams"] * 5 and r["added_p50_ms"] >= 0 for r in rows)


def test_benchmark_rejects_bad_levels(capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser()
    bench.configure(parser)
    assert bench.run(parser.parse_args(["--streams", "0"])) == 2
    assert "--streams" in capsys.readouterr().err
