"""``star bench proxy-hold``: a short quick hold runs with 0 errors and reports its fields."""

from __future__ import annotations

import argparse
import json
from dataclasses import fields

import pytest

from benchmarks import proxy_hold as bench


def test_quick_hold_has_no_errors_and_cuts_the_clients_that_never_read(
    capsys: pytest.CaptureFixture[str],
) -> None:
    parser = argparse.ArgumentParser()
    bench.configure(parser)
    args = parser.parse_args(
        ["--quick", "--hold-s", "20", "--window-s", "5", "--write-stall-s", "3", "--json"]
    )
    assert bench.run(args) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["config"]["streams"] == 200 and out["config"]["stalled"] == 10
    windows, summary = out["windows"], out["summary"]
    assert len(windows) == 4
    assert all(set(w) == {f.name for f in fields(bench.Window)} for w in windows)
    assert all(w["errors"] == 0 and w["tokens"] > 0 and w["rss_mib"] > 0 for w in windows)
    # How many are open at a window's end depends on the machine's load (the
    # client reopens them); that they are served without errors does not.
    assert all(w["open_streams"] > 0 for w in windows)
    assert summary["errors"] == 0 and summary["error_samples"] == []
    assert summary["streams_done"] > 0 and summary["added_p99_ms"] >= summary["added_p50_ms"] >= 0
    # Each client that never reads holds at most about one write buffer (64 KiB) in the proxy.
    assert summary["buffered_max_kib"] <= 10 * (64 + 16)
    assert summary["stalled_cut"] >= 1
    assert summary["stalled_opened"] >= 10


def test_bad_flags_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser()
    bench.configure(parser)
    assert bench.run(parser.parse_args(["--streams", "0"])) == 2
    assert "--streams" in capsys.readouterr().err
