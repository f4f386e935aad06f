"""``star bench NAME``: the benchmarks in ``benchmarks/``, each printing a table.

Each benchmark module exposes ``configure(parser)`` and ``run(args) -> int``
and also runs as ``python -m benchmarks.NAME``. Speed targets are checked
here, in benchmarks, never in timed unit tests.
"""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Callable

BENCHMARKS: dict[str, tuple[str, str]] = {
    "planner": ("benchmarks.planner", "scheduler tick time vs cluster size, next to the naive O(|O||U|RH) rule"),
    "simulator": ("benchmarks.simulator", "simulated seconds per wall second by cluster size"),
    "proxy": ("benchmarks.proxy", "proxy relay throughput and added latency per token"),
    "proxy-hold": ("benchmarks.proxy_hold", "N SSE streams held open for minutes (+ clients that never read): added latency, proxy RSS and errors per window"),
    "predictor": ("benchmarks.predictor", "length-predictor MLP latency at batch 1/10/64 (CPU, and GPU if present)"),
    "serve": ("benchmarks.serve", "load generator for a live proxy: Poisson arrivals, TTFT/TPOT/E2E, goodput"),
    "migration": ("benchmarks.migration", "D->D handoff stall as the client sees it, KV bytes moved, co-running slowdown"),
    "scheduler": ("benchmarks.scheduler_load", "a real star scheduler + redis-server fed by N emulated decode workers: tick p50/p99, report lag, Redis CPU/memory"),
    "chaos": ("benchmarks.chaos.run", "faults injected into a fleet spread over network namespaces, under load: tokens lost/duplicated, KV leaked, recovery (root)"),
    "wire": ("benchmarks.wire", "star.wire encode and decode time per message kind (a 64-request Report, the bus messages, the frames)"),
    "conformance": ("benchmarks.conformance", "one table of OpenAI requests to vLLM's own server and to STAR on the same model, compared field by field (--migrate: each moved mid-request)"),
    "e2e": ("benchmarks.e2e", "STAR vs static P->D dispatch on a real fleet: modes x rates x seeds, two regimes (paper Fig. 9-11)"),
}


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = sub.add_parser(
        "bench",
        help="run a benchmark and print its table",
        description="Benchmarks measure STAR's speed targets (docs/design.md §7) and print a table (or --json rows).",
    )
    inner = parser.add_subparsers(dest="bench", metavar="NAME", required=True)
    for name, (module, help_text) in BENCHMARKS.items():
        # The module (and what it imports: httpx, matplotlib, ...) loads only when
        # its benchmark runs: its own parser then reads the rest of the command line.
        bench = inner.add_parser(name, help=help_text, add_help=False)
        bench.add_argument("argv", nargs=argparse.REMAINDER)
        bench.set_defaults(func=_runner(name, module, help_text))


def _runner(name: str, module: str, help_text: str) -> Callable[[argparse.Namespace], int]:
    def run(args: argparse.Namespace) -> int:
        bench = importlib.import_module(module)
        parser = argparse.ArgumentParser(prog=f"star bench {name}", description=help_text)
        bench.configure(parser)
        return int(bench.run(parser.parse_args(args.argv)))

    return run
