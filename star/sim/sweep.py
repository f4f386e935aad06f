"""Many simulated runs on a process pool, with a progress bar.

Runs are independent and deterministic, so a sweep is a map over configs.
Jobs are submitted largest first (cost grows with decode instances x
duration, and runs that call the planner cost more), which keeps two
workers busy to the end.
"""

from __future__ import annotations

import multiprocessing
import sys
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ProcessPoolExecutor, as_completed
from dataclasses import replace
from typing import Any

import numpy as np
from tqdm import tqdm

from star.planner.types import ModeKind
from star.sim.config import SimConfig
from star.sim.engine import simulate
from star.sim.metrics import RequestLog, SimResult
from star.sim.workload import Workload


def slim(result: SimResult) -> SimResult:
    """The result without its per-request log (what a sweep sends between processes)."""
    empty_f = np.zeros(0)
    empty_i = np.zeros(0, dtype=np.int64)
    log = RequestLog(empty_f, empty_i, empty_i, empty_f, empty_f, empty_i, empty_i, empty_i)
    return replace(result, requests=log)


def _run(config: SimConfig, workload: Workload | None, keep_requests: bool) -> SimResult:
    result = simulate(config, workload)
    return result if keep_requests else slim(result)


def cost(config: SimConfig) -> float:
    """A rough relative cost of a run, for ordering the queue."""
    planning = config.parsed_mode.kind is not ModeKind.NO_MIGRATION
    return config.decode_instances * config.duration_s * (4.0 if planning else 1.0)


def sweep(
    configs: Sequence[SimConfig],
    workload: Workload | None = None,
    *,
    jobs: int = 2,
    progress: bool | None = None,
    keep_requests: bool = False,
    on_result: Callable[[int, SimResult], None] | None = None,
) -> list[SimResult]:
    """Run every config; results come back in the order of ``configs``.

    ``jobs`` worker processes (1: run here, no pool). ``progress`` shows a
    tqdm bar over runs, or over simulated seconds for a single run (default:
    when stderr is a terminal). ``on_result`` is called with (index, result)
    as runs complete.
    """
    if progress is None:
        progress = sys.stderr.isatty()
    if len(configs) == 1:
        with tqdm(
            total=configs[0].duration_s,
            unit="sim s",
            desc="simulate",
            disable=not progress,
            dynamic_ncols=True,
        ) as one:

            def advance(seconds: float) -> None:
                one.update(seconds)

            result = simulate(configs[0], workload, progress=advance)
        result = result if keep_requests else slim(result)
        if on_result is not None:
            on_result(0, result)
        return [result]
    results: list[SimResult | None] = [None] * len(configs)
    order = sorted(range(len(configs)), key=lambda i: -cost(configs[i]))
    bar = tqdm(
        total=len(configs), unit="run", desc="simulate", disable=not progress, dynamic_ncols=True
    )
    try:
        if jobs <= 1:
            for i in order:
                results[i] = _run(configs[i], workload, keep_requests)
                _done(bar, i, results[i], on_result)
        else:
            ctx = multiprocessing.get_context("spawn")
            with ProcessPoolExecutor(max_workers=jobs, mp_context=ctx) as pool:
                futures: dict[Future[SimResult], int] = {
                    pool.submit(_run, configs[i], workload, keep_requests): i for i in order
                }
                for fut in as_completed(futures):
                    i = futures[fut]
                    results[i] = fut.result()
                    _done(bar, i, results[i], on_result)
    finally:
        bar.close()
    return [r for r in results if r is not None]


def _done(
    bar: Any, i: int, result: SimResult | None, on_result: Callable[[int, SimResult], None] | None
) -> None:
    assert result is not None
    row = result.row
    bar.set_postfix_str(f"{row['mode']} n={row['instances']} seed={row['seed']}", refresh=False)
    bar.update(1)
    if on_result is not None:
        on_result(i, result)
