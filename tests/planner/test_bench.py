"""`star bench planner` / `python -m benchmarks.planner`, on a tiny run."""

from __future__ import annotations

import argparse
import json

import pytest

from benchmarks import planner as bench
from star.planner import PlannerParams


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    bench.configure(parser)
    return parser.parse_args(argv)


def test_json_rows_have_the_agreed_keys(capsys: pytest.CaptureFixture[str]) -> None:
    code = bench.run(
        parse(["--sizes", "8,16", "--ticks", "3", "--naive-ticks", "1", "--horizon", "8", "--json"])
    )
    assert code == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["instances"] for r in rows] == [8, 16]
    for r in rows:
        assert set(r) == {
            "instances",
            "requests_per_instance",
            "horizon",
            "median_ms",
            "p99_ms",
            "naive_median_ms",
        }
        assert r["requests_per_instance"] == 64 and r["horizon"] == 8
        assert 0 < r["median_ms"] <= r["p99_ms"]
        assert r["naive_median_ms"] > 0


def test_table_and_states_are_imbalanced(capsys: pytest.CaptureFixture[str]) -> None:
    assert (
        bench.run(parse(["--sizes", "8", "--ticks", "2", "--naive-ticks", "0", "--worker-traces"]))
        == 0
    )
    out = capsys.readouterr().out
    assert "median ms" in out and "worker traces" in out
    rows = bench.bench([8], 16, PlannerParams(horizon=4), 2, 0, seed=1)
    assert rows[0].overloaded >= 1 and rows[0].underloaded >= 1
    assert rows[0].naive_median_ms is None


def test_bad_sizes_are_rejected(capsys: pytest.CaptureFixture[str]) -> None:
    assert bench.run(parse(["--sizes", "eight"])) == 2
    assert "--sizes 'eight'" in capsys.readouterr().err


def test_naive_up_to_and_max_migrations(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--sizes", "8,16", "--ticks", "2", "--naive-ticks", "1", "--horizon", "4"]
    assert bench.run(parse([*argv, "--naive-up-to", "8", "--max-migrations", "1"])) == 0
    out = capsys.readouterr().out
    assert "M=1" in out
    rows = [line.split() for line in out.splitlines() if line.strip()[:2] in {"8 ", "16"}]
    assert rows[0][5] != "-" and rows[1][5] == "-"  # naive median ms: timed only up to 8
    assert [r[-1] for r in rows] == ["1.00", "1.00"]  # one move per tick
    with pytest.raises(SystemExit):
        parse([*argv, "--max-migrations", "many"])
    assert 'expected "auto" or an integer' in capsys.readouterr().err
    with pytest.raises(SystemExit):  # scheduler.max_migrations's rule: M >= 1
        parse([*argv, "--max-migrations", "0"])
    assert 'must be "auto" or an integer >= 1' in capsys.readouterr().err
