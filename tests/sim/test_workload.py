"""Workloads: Table 2 statistics of the generator, and the real file formats."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from star.sim.workload import (
    MAX_OUTPUT_TOKENS,
    TABLE2,
    WorkloadError,
    approx_tokens,
    load,
    load_alpaca,
    load_sharegpt,
    load_trace,
    poisson_arrivals,
    stats,
    synthetic,
)


@pytest.mark.parametrize("name", ["sharegpt", "alpaca"])
@pytest.mark.parametrize("which", ["input", "output"])
def test_synthetic_matches_table2_within_10_percent(name: str, which: str) -> None:
    w = synthetic(name, 200_000, np.random.default_rng(7))
    got = stats(w.prompt_tokens if which == "input" else w.output_tokens)
    for key, want in TABLE2[name][which].items():
        assert got[key] == pytest.approx(want, rel=0.10), (name, which, key, got[key], want)


def test_synthetic_outputs_are_capped_and_sharegpt_matches_fig2() -> None:
    w = synthetic("sharegpt", 100_000, np.random.default_rng(1))
    assert int(w.output_tokens.max()) <= MAX_OUTPUT_TOKENS
    assert int(w.prompt_tokens.min()) >= 1 and int(w.output_tokens.min()) >= 1
    # Paper §3.2: "29.2% requests generating fewer than 1K tokens ... 17.3% with
    # exceeding 30K tokens".
    assert np.mean(w.output_tokens < 1000) == pytest.approx(0.292, abs=0.01)
    assert np.mean(w.output_tokens > 30_000) == pytest.approx(0.173, abs=0.01)


def test_synthetic_is_deterministic_per_seed() -> None:
    a = synthetic("alpaca", 1000, np.random.default_rng(3))
    b = synthetic("alpaca", 1000, np.random.default_rng(3))
    assert np.array_equal(a.output_tokens, b.output_tokens)
    with pytest.raises(WorkloadError, match="unknown synthetic workload 'nope'"):
        synthetic("nope", 10, np.random.default_rng(0))


def test_sharegpt_file_uses_recorded_lengths_and_counts_text(tmp_path: Path) -> None:
    records = [
        {
            "id": "a",
            "conversations": [
                {"from": "human", "value": "hello there"},
                {"from": "gpt", "value": "x" * 40},
            ],
        },
        {
            "id": "b",
            "output_tokens": 9000,
            "prompt_tokens": 12,
            "conversations": [{"from": "human", "value": "why?"}, {"from": "gpt", "value": "ok"}],
        },
        {"id": "c", "conversations": [{"from": "human", "value": "only one turn"}]},
    ]
    path = tmp_path / "sg.json"
    path.write_text(json.dumps(records))
    w = load_sharegpt(path)
    assert len(w) == 2  # the one-turn record is skipped
    assert w.prompt_tokens.tolist() == [approx_tokens("hello there"), 12]
    assert w.output_tokens.tolist() == [10, 9000]
    assert w.arrival_s is None
    assert load(str(path)) is not None


def test_alpaca_file(tmp_path: Path) -> None:
    records = [
        {"instruction": "Name three colours.", "input": "", "output": "Red, green and blue."},
        {"instruction": "Translate", "input": "bonjour", "output": "hello", "output_len": 4000},
    ]
    path = tmp_path / "alpaca.json"
    path.write_text(json.dumps(records))
    w = load_alpaca(path)
    assert w.prompt_tokens.tolist() == [
        approx_tokens("Name three colours."),
        approx_tokens("Translate\n\nbonjour"),
    ]
    assert w.output_tokens.tolist() == [approx_tokens("Red, green and blue."), 4000]
    sniffed = load(str(path))
    assert not isinstance(sniffed, str) and sniffed.name == "alpaca-file"


def test_timestamps_make_a_trace(tmp_path: Path) -> None:
    lines = [
        {"timestamp": 2500, "input_length": 100, "output_length": 7},
        {"timestamp": 500, "input_length": 30, "output_length": 5},
    ]
    path = tmp_path / "trace.jsonl"
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    w = load_trace(path)
    assert w.arrival_s is not None
    assert w.arrival_s.tolist() == [0.0, 2.0]  # sorted, relative, in seconds
    assert w.prompt_tokens.tolist() == [30, 100]


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("{}", "expected a JSON list"),
        ('[{"conversations": 3}]', "no 'conversations' list"),
        (
            '[{"conversations": [], "output_tokens": -1, "prompt_tokens": 1}]',
            "must be a non-negative number",
        ),
        ("not json", "not JSON"),
    ],
)
def test_bad_files_fail_with_the_reason(tmp_path: Path, content: str, message: str) -> None:
    path = tmp_path / "bad.json"
    path.write_text(content)
    with pytest.raises(WorkloadError, match=message):
        load_sharegpt(path)


def test_unknown_workload_name() -> None:
    with pytest.raises(WorkloadError, match="neither a file nor one of"):
        load("/no/such/file.json")


def test_poisson_arrivals_have_the_rate() -> None:
    t = poisson_arrivals(2.0, 5000.0, np.random.default_rng(0))
    assert t.size == pytest.approx(10_000, rel=0.05)
    assert bool(np.all(np.diff(t) > 0)) and float(t.max()) < 5000.0
