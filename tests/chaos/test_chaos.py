"""The quick chaos suite on a fleet spread over network namespaces (``star bench chaos --quick``).

Every process on its own simulated host, real engines, NIXL over TCP; the
faults of the quick set injected under load. Skipped, with the reason, where
network namespaces cannot be made (not root, no iproute2).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.chaos.netns import unavailable
from benchmarks.chaos.scenarios import SCENARIOS
from tests.procs import cluster_env, reaper

QUICK = {name for name, (_, quick) in SCENARIOS.items() if quick}
# The quick run takes 2.5-5 min (the fleet's start included); past RUN_S it is
# stopped and what it printed so far is the failure. The test's own limit is above it.
RUN_S = 840


@pytest.mark.timeout(RUN_S + 60)
def test_quick_chaos_suite_loses_nothing(tmp_path: Path) -> None:
    reason = unavailable()
    if reason is not None:
        pytest.skip(f"chaos suite not run: {reason}")
    out = tmp_path / "rows.json"
    before = _namespaces()
    with reaper(str(tmp_path)) as mark:
        done = _run_quick(out, cluster_env(**mark))
    assert out.exists(), f"no rows (exit {done.returncode}):\n{done.stderr[-3000:]}"
    rows = {row["scenario"]: row for row in json.loads(out.read_text())}
    assert set(rows) == QUICK, done.stderr[-3000:]
    for name, row in rows.items():
        assert "scenario_failed" not in row, (name, row)
        # Every client got its whole, correct stream (no fault here is allowed to cut one).
        assert row["ok"] == row["streams"], _diagnosis(name, row, out)
        assert row["lost"] == row["duplicated"] == row["wrong"] == 0, (name, row)
        assert row["leaked_kv_tokens"] == 0, (name, row)
        assert row["recovery_s"] is not None, (name, row)
    assert rows["scheduler-kill"]["new_leader_s"] is not None
    assert rows["scheduler-kill"]["new_leader_s"] < 15
    assert rows["decode-kill"].get("decode-0_back_s") is not None
    # The killed proxy's clients came back for the rest of their streams (exact, above).
    assert rows["proxy-kill-resume"].get("resumed", 0) > 0, rows["proxy-kill-resume"]
    assert done.returncode == 0, done.stderr[-3000:]
    assert not [line for line in done.stderr.splitlines() if "left behind" in line]
    assert _namespaces() <= before, "the run left network namespaces behind"


def _run_quick(out: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """``benchmarks.chaos.run --quick``; past RUN_S interrupted (its fleet and
    namespaces are taken down) and what it printed so far is the failure."""
    argv = [sys.executable, "-m", "benchmarks.chaos.run", "--quick", "--tokens", "600",
            "--out", str(out)]  # fmt: skip
    cwd = Path(__file__).resolve().parents[2]
    with subprocess.Popen(
        argv, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    ) as proc:
        try:
            stdout, stderr = proc.communicate(timeout=RUN_S)
        except subprocess.TimeoutExpired:
            proc.terminate()  # the run stops its fleet and removes its namespaces
            try:
                _, stderr = proc.communicate(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                _, stderr = proc.communicate()
            pytest.fail(f"the quick chaos run took over {RUN_S} s; it printed:\n{stderr[-4000:]}")
    return subprocess.CompletedProcess(argv, proc.returncode, stdout, stderr)


def _diagnosis(name: str, row: dict[str, object], out: Path) -> str:
    """What a failed row says, and every warning or error the fleet logged: all a CI log keeps."""
    lines = [f"{name}: {json.dumps(row, sort_keys=True)}"]
    # The failed clients' request ids (each example starts with one): every line naming them.
    failed = [str(e).split(":", 1)[0] for e in row.get("examples", [])]  # type: ignore[attr-defined]
    failed = [rid for rid in failed if len(rid) > 8]
    for log in sorted((out.parent / f"{out.stem}-logs").glob("*.log")):
        noted = [
            line.strip()[:400]
            for line in log.read_text(errors="replace").splitlines()
            if '"level": "warning"' in line
            or '"level": "error"' in line
            or "Traceback" in line
            or any(rid in line for rid in failed)
        ]
        if noted:
            lines.append(f"-- {log.name}: {len(noted)} warnings/errors, the first 30:")
            lines.extend(noted[:30])
    return "\n".join(lines)


def _namespaces() -> set[str]:
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return {line.split()[0] for line in listed.splitlines() if line.startswith("star")}
