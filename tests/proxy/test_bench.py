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


def test_benchmark_relays_through_the_token_protocol_sealed_and_not(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """``--seal on,off``: a worker process serves the tokens over the token protocol, with
    cluster.secret and without; every token arrives in both settings, interleaved."""
    parser = argparse.ArgumentParser()
    bench.configure(parser)
    argv = "--seal on,off --streams 1,4 --tokens 200 --repeats 2 --relay-rate 2000 --json"
    args = parser.parse_args(argv.split())
    assert bench.run(args) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["streams"] for r in rows] == [1, 4]
    for row in rows:
        assert row["tokens"] == 200 and row["missing_tokens"] == 0
        assert sorted(row["tokens_per_core_s"]) == ["off", "on"]
        assert all(len(v) == 2 and min(v) > 0 for v in row["tokens_per_core_s"].values())
        assert row["ratio_min"] <= row["ratio_on_off"] <= row["ratio_max"]
        assert row["ratio_min"] <= row["ratio_p25"] <= row["ratio_p75"] <= row["ratio_max"]


def test_benchmark_rejects_an_unknown_seal_setting(capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser()
    bench.configure(parser)
    assert bench.run(parser.parse_args(["--seal", "maybe"])) == 2
    assert "--seal" in capsys.readouterr().err
