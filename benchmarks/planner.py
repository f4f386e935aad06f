"""``star bench planner``: scheduler tick time against cluster size.

Times :func:`star.planner.plan` on imbalanced random cluster states (8 to
1,024 decode instances x 64 running requests, H = 64, M = ``auto`` by
default) next to the straightforward O(|O|·|U|·R·H)-per-move implementation
of the same rule (the tests' brute-force oracle, ``tests/planner/reference.py``,
loaded from the checkout this package is installed from; up to
``--naive-up-to`` instances: it takes minutes beyond), in the same process,
pinned to one CPU. docs/design.md §7: "scheduler tick, 256 decode instances x 64
requests, H = 64 | paper: < 300 ms | >= 300x the naive rule in the same run,
several moves per tick".

Each state draws a per-instance load multiplier (log-normal, sigma 0.35) so
that the overloaded set O and the underloaded set U are both non-empty, as
after a burst of long generations; request sizes are prompt (log-normal,
median 600) + generated (uniform 0..3000) tokens, predicted remaining lengths
are log-normal (median 1,500, sigma 1.2: heavy-tailed, many past the horizon)
with 5 % not predicted yet.

Run ``python -m benchmarks.planner --help``.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib.util
import json
import os
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.common import bench_main, text_table
from star.planner import Instance, Mode, PlannerParams, Request, plan
from star.planner.trace import instance_traces
from star.settings import add_setting_flag

REFERENCE = Path(__file__).resolve().parents[1] / "tests" / "planner" / "reference.py"
DEFAULT_SIZES = (8, 16, 32, 64, 128, 256, 1024)
# Distinct states cycled through per size: enough to vary O, U and the
# winner, few enough that building them stays cheap next to the timing.
_STATES = 12


def random_cluster(
    rng: np.random.Generator,
    instances: int,
    requests: int,
    *,
    params: PlannerParams | None = None,
    worker_traces: bool = False,
) -> list[Instance]:
    """An imbalanced random cluster state (see the module docstring)."""
    out: list[Instance] = []
    for i in range(instances):
        scale = float(np.exp(rng.normal(0.0, 0.35)))
        tokens = (
            rng.lognormal(np.log(600.0), 0.8, requests) + rng.uniform(0, 3000, requests)
        ) * scale
        predicted = rng.lognormal(np.log(1500.0), 1.2, requests)
        unknown = rng.random(requests) < 0.05
        truth = predicted * rng.uniform(0.5, 1.5, requests)
        reqs = tuple(
            Request(
                id=f"d{i}-r{j}",
                tokens=int(tokens[j]),
                predicted_remaining=None if unknown[j] else float(predicted[j]),
                true_remaining=int(truth[j]) + 1,
                generated=int(rng.integers(0, 3000)),
            )
            for j in range(requests)
        )
        out.append(
            Instance(
                id=f"d{i}",
                requests=reqs,
                capacity_tokens=400_000,
                bytes_per_token=131_072,
                step_time_s=0.02,
            )
        )
    if worker_traces:
        # What workers report (Algorithm 1's "pre-simulated state").
        traces = instance_traces(out, params or PlannerParams())
        out = [
            Instance(
                inst.id,
                inst.requests,
                inst.capacity_tokens,
                inst.bytes_per_token,
                inst.step_time_s,
                trace=tuple(traces[i].tolist()),
            )
            for i, inst in enumerate(out)
        ]
    return out


@dataclass(frozen=True, slots=True)
class Row:
    """One line of the result."""

    instances: int
    requests_per_instance: int
    horizon: int
    median_ms: float
    p99_ms: float
    naive_median_ms: float | None
    overloaded: float
    underloaded: float
    moves: float

    def public(self) -> dict[str, Any]:
        """The keys of ``--json`` (the contract with ``star bench planner``)."""
        return {
            "instances": self.instances,
            "requests_per_instance": self.requests_per_instance,
            "horizon": self.horizon,
            "median_ms": self.median_ms,
            "p99_ms": self.p99_ms,
            "naive_median_ms": self.naive_median_ms,
        }


@contextlib.contextmanager
def one_cpu() -> Iterator[int | None]:
    """Pin this process to one of its CPUs for the duration (Linux), then restore."""
    getter = getattr(os, "sched_getaffinity", None)
    setter = getattr(os, "sched_setaffinity", None)
    if getter is None or setter is None:
        yield None
        return
    before = getter(0)
    cpu = max(before)  # the last CPU tends to be the least busy with system work
    setter(0, {cpu})
    try:
        yield cpu
    finally:
        setter(0, before)


CLOCKS: dict[str, Callable[[], float]] = {
    "wall": time.perf_counter,
    # CPU time of this thread: leaves out the time other processes hold the
    # core, which dominates wall time on a shared, oversubscribed machine.
    "cpu": time.thread_time,
}


def reference_plan() -> Callable[..., Any]:
    """The brute-force oracle's ``reference_plan``: it lives with the tests (production code
    has one Algorithm 1), so the bench loads it from the checkout it is installed from."""
    if not REFERENCE.is_file():
        raise SystemExit(
            f"bench planner: the naive reference ({REFERENCE}) is part of a STAR checkout, "
            "not of an installed package; run from a checkout (pip install -e .) or pass "
            "--naive-ticks 0"
        )
    spec = importlib.util.spec_from_file_location("star_planner_reference", REFERENCE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.reference_plan  # type: ignore[no-any-return]


def _times(
    fn: Callable[[Sequence[Instance]], object],
    states: Sequence[Sequence[Instance]],
    ticks: int,
    clock: Callable[[], float] = time.perf_counter,
) -> list[float]:
    gc.collect()
    out: list[float] = []
    for t in range(ticks):
        state = states[t % len(states)]
        start = clock()
        fn(state)
        out.append(clock() - start)
    return out


def bench(
    sizes: Sequence[int],
    requests: int,
    params: PlannerParams,
    ticks: int,
    naive_ticks: int,
    seed: int,
    *,
    worker_traces: bool = False,
    clock: str = "wall",
    naive_up_to: int | None = None,
) -> list[Row]:
    """Measure every size; ``naive_ticks`` = 0 skips the reference, as do sizes
    above ``naive_up_to`` (None: no limit)."""
    tick = CLOCKS[clock]
    rng = np.random.default_rng(seed)
    rows: list[Row] = []
    naive_plan = reference_plan() if naive_ticks > 0 else None
    for n in sizes:
        states: list[list[Instance]] = []
        stats: list[tuple[int, int, int]] = []
        while len(states) < _STATES:
            state = random_cluster(rng, n, requests, params=params, worker_traces=worker_traces)
            result = plan(state, params)
            if result.overloaded and result.underloaded:
                states.append(state)
                stats.append((len(result.overloaded), len(result.underloaded), len(result.moves)))
        # One warm-up pass so first-call costs (imports, caches) are not timed.
        _times(lambda s: plan(s, params), states, len(states))
        fast = np.array(_times(lambda s: plan(s, params), states, ticks, tick)) * 1e3
        naive: float | None = None
        if naive_plan is not None and (naive_up_to is None or n <= naive_up_to):
            slow = _times(lambda s: naive_plan(s, params), states, naive_ticks, tick)
            naive = float(np.median(slow) * 1e3)
        o, u, m = (float(np.mean(col)) for col in zip(*stats, strict=True))
        rows.append(
            Row(
                instances=n,
                requests_per_instance=requests,
                horizon=params.horizon,
                median_ms=float(np.median(fast)),
                p99_ms=float(np.percentile(fast, 99)),
                naive_median_ms=naive,
                overloaded=o,
                underloaded=u,
                moves=m,
            )
        )
    return rows


def configure(parser: argparse.ArgumentParser) -> None:
    """Add this benchmark's flags to ``parser`` (``star bench planner`` and ``-m``)."""
    parser.add_argument(
        "--sizes",
        default=",".join(map(str, DEFAULT_SIZES)),
        help="comma-separated decode instance counts (default %(default)s)",
    )
    parser.add_argument("--requests", type=int, default=64, help="running requests per instance")
    # The planner's knobs, as the settings describe and check them.
    add_setting_flag(parser, "--horizon", "scheduler.horizon", metavar="H")
    add_setting_flag(parser, "--mode", "scheduler.mode", metavar="MODE")
    parser.add_argument("--ticks", type=int, default=300, help="timed ticks per size")
    parser.add_argument(
        "--naive-ticks",
        type=int,
        default=3,
        help="timed ticks of the naive reference per size (0 skips it; slow at 256)",
    )
    parser.add_argument(
        "--naive-up-to",
        type=int,
        default=256,
        metavar="N",
        help="time the naive reference only up to N instances (default %(default)s: "
        "with several moves per tick it takes ~30 s a tick at 256 and grows as n^3)",
    )
    add_setting_flag(parser, "--max-migrations", "scheduler.max_migrations", metavar="M")
    parser.add_argument(
        "--worker-traces",
        action="store_true",
        help="give the planner the workers' pre-simulated traces (live scheduler) "
        "instead of having it simulate every request (simulator)",
    )
    parser.add_argument(
        "--clock",
        choices=sorted(CLOCKS),
        default="wall",
        help="wall: elapsed time (default); cpu: this thread's CPU time, for shared machines",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="print rows as a JSON list")


def run(args: argparse.Namespace) -> int:
    """Run the benchmark described by ``args``; print a table or ``--json``."""
    try:
        sizes = [int(s) for s in str(args.sizes).split(",") if s.strip()]
        if not sizes or min(sizes) < 2:
            raise ValueError
    except ValueError:
        print(f"bench planner: --sizes {args.sizes!r}: expected integers >= 2", file=sys.stderr)
        return 2
    if args.ticks < 1 or args.requests < 1 or args.naive_ticks < 0:
        print(
            "bench planner: --ticks and --requests must be >= 1, --naive-ticks >= 0",
            file=sys.stderr,
        )
        return 2
    try:
        params = PlannerParams(
            mode=Mode.parse(args.mode), horizon=args.horizon, max_migrations=args.max_migrations
        )
    except ValueError as exc:
        print(f"bench planner: {exc}", file=sys.stderr)
        return 2
    with one_cpu() as cpu:
        rows = bench(
            sizes,
            args.requests,
            params,
            args.ticks,
            args.naive_ticks,
            args.seed,
            worker_traces=args.worker_traces,
            clock=args.clock,
            naive_up_to=args.naive_up_to,
        )
    if args.json:
        print(json.dumps([r.public() for r in rows]))
        return 0
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(
        f"planner tick ({args.clock} clock), mode {params.mode}, H={params.horizon}, "
        f"M={params.max_migrations}, "
        f"{args.ticks} ticks per size, "
        f"pinned to CPU {cpu}, load average {load:.2f}"
        f"{', worker traces' if args.worker_traces else ''}"
    )
    header = (
        "instances",
        "req/inst",
        "H",
        "median ms",
        "p99 ms",
        "naive median ms",
        "speed-up",
        "|O|",
        "|U|",
        "moves",
    )
    table = [header]
    for r in rows:
        naive = "-" if r.naive_median_ms is None else f"{r.naive_median_ms:.1f}"
        speed = "-" if r.naive_median_ms is None else f"{r.naive_median_ms / r.median_ms:.0f}x"
        table.append(
            (
                str(r.instances),
                str(r.requests_per_instance),
                str(r.horizon),
                f"{r.median_ms:.3f}",
                f"{r.p99_ms:.3f}",
                naive,
                speed,
                f"{r.overloaded:.1f}",
                f"{r.underloaded:.1f}",
                f"{r.moves:.2f}",
            )
        )
    print(text_table(table))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m benchmarks.planner``."""
    return bench_main("benchmarks.planner", configure, run, __doc__, argv)


if __name__ == "__main__":
    sys.exit(main())
