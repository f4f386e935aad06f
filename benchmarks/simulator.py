"""``star bench simulator``: simulated seconds per wall second against cluster size.

Runs the simulator (:mod:`star.sim`) once per cluster size and mode on the
default ShareGPT-like load (0.4 req/s per 8 decode instances: paper §6.3's
0.3 req/s per 8-instance cluster of 2 prefill + 6 decode)
and prints how many simulated seconds it covers per second of wall time
and of CPU time. docs/design.md §7: "simulator, 256 instances, 2,000 simulated s,
ShareGPT-like load | Llumnix emulator ~1x real time; Vidur; BLIS ~67x |
>= 1,000x real time; the whole 8->256 sweep of 4 modes < 5 min".

``no-migration`` measures the event engine alone (decode iterations in
closed form, vectorised ticks); the planning modes add one call of
:func:`star.planner.plan` per tick (1 s) and the building of its input.

Run ``python -m benchmarks.simulator --help``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass

from benchmarks.common import bench_main, text_table
from star.settings import add_setting_flag
from star.sim import SimConfig, simulate

DEFAULT_SIZES = (8, 16, 32, 64, 128, 256)


@dataclass(frozen=True)
class Row:
    """One timed run."""

    instances: int
    mode: str
    sim_seconds: float
    wall_seconds: float
    cpu_seconds: float
    planner_calls: int

    @property
    def speed(self) -> float:
        """Simulated seconds per wall second."""
        return self.sim_seconds / self.wall_seconds if self.wall_seconds > 0 else float("inf")

    @property
    def cpu_speed(self) -> float:
        """Simulated seconds per CPU second of this process."""
        return self.sim_seconds / self.cpu_seconds if self.cpu_seconds > 0 else float("inf")


def configure(parser: argparse.ArgumentParser) -> None:
    """Add this benchmark's flags to ``parser`` (``star bench simulator`` and ``-m``)."""
    parser.add_argument(
        "--sizes",
        default=",".join(map(str, DEFAULT_SIZES)),
        help="comma-separated decode instance counts (default %(default)s)",
    )
    parser.add_argument(
        "--modes",
        default="no-migration,current,predicted,oracle",
        help="comma-separated modes (default %(default)s)",
    )
    add_setting_flag(parser, "--duration", "simulator.duration_s", metavar="S")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--json", action="store_true", help="print rows as a JSON list")


def measure(instances: int, mode: str, duration_s: float, seed: int) -> Row:
    """Time one run."""
    cfg = SimConfig(decode_instances=instances, mode=mode, duration_s=duration_s, seed=seed)
    wall = time.perf_counter()
    cpu = time.process_time()
    result = simulate(cfg)
    cpu = time.process_time() - cpu
    wall = time.perf_counter() - wall
    return Row(instances, mode, duration_s, wall, cpu, int(result.row["planner_calls"]))


def run(args: argparse.Namespace) -> int:
    """Run the benchmark and print a table (or JSON)."""
    sizes = [int(x) for x in args.sizes.split(",") if x.strip()]
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    from star.sim.kernels import warm

    warm()  # numba kernels compiled or loaded before any clock starts
    rows = [measure(n, mode, args.duration, args.seed) for mode in modes for n in sizes]
    if args.json:
        json.dump(
            [
                {
                    "instances": r.instances,
                    "mode": r.mode,
                    "sim_seconds": r.sim_seconds,
                    "wall_seconds": r.wall_seconds,
                    "cpu_seconds": r.cpu_seconds,
                    "sim_per_wall": r.speed,
                    "sim_per_cpu": r.cpu_speed,
                    "planner_calls": r.planner_calls,
                }
                for r in rows
            ],
            sys.stdout,
        )
        sys.stdout.write("\n")
        return 0
    header = (
        "mode",
        "decode",
        "sim s",
        "wall s",
        "cpu s",
        "sim s / wall s",
        "sim s / cpu s",
        "planner calls",
    )
    table = [header] + [
        (
            r.mode,
            str(r.instances),
            f"{r.sim_seconds:.0f}",
            f"{r.wall_seconds:.2f}",
            f"{r.cpu_seconds:.2f}",
            f"{r.speed:,.0f}x",
            f"{r.cpu_speed:,.0f}x",
            str(r.planner_calls),
        )
        for r in rows
    ]
    print(text_table(table))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m benchmarks.simulator``."""
    return bench_main("benchmarks.simulator", configure, run, __doc__, argv)


if __name__ == "__main__":
    sys.exit(main())
