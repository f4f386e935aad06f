"""``star bench e2e``: STAR against static P->D dispatch on a real fleet (paper §6, Fig. 9-11).

For each regime, scheduler mode, request rate and seed, a fresh fleet (the
code path of ``star up``: 1 prefill + 3 decode vLLM workers on the tiny
model, the scheduler, the proxy, a private Redis) replays the same seeded
workload; per request the client's TTFT, TPOT and E2E, per decode instance
over time its KV use, running and waiting requests, step time and vLLM's own
preemption counter, and every decision and migration outcome go to
``--out`` (one folder per cell; finished cells are skipped, so a stopped run
resumes). Every mode of a seed serves the same requests, greedy, so with the
same output lengths; the first table pairs them request by request against
``no-migration`` (:mod:`benchmarks.e2e.compare`: length match, P99 TPOT
pooled over seeds with a bootstrap interval of the ratio, completed
migrations apart from decisions), the second gives each cell's numbers as a
mean and 95 % t-interval over seeds; the figures are made from that folder.

    star bench e2e --quick                       # 2 regimes x 2 modes x 1 rate x 1 seed
    star bench e2e --out build/e2e --figures docs/img
    star bench e2e --out build/e2e --report-only --json
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.e2e.compare import comparison_rows, comparison_table
from benchmarks.e2e.regimes import (
    DEFAULT_RATES,
    QUICK_RATES,
    REGIMES,
    default_max_model_len,
    regime,
)
from benchmarks.e2e.report import (
    MODES,
    Cell,
    aggregate,
    cell_of,
    cluster_name,
    cluster_of,
    group_of,
    live_table,
    load_all,
    load_cell,
    load_requests,
    row,
    sim_table,
    table,
    write_cell,
)

QUICK = {"modes": "no-migration,predicted", "seeds": "1", "num_prompts": 40}


def _csv(text: str) -> list[str]:
    return [x.strip() for x in str(text).split(",") if x.strip()]


def configure(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = (
        "regimes: memory = KV capacity per decode instance of --kv-requests largest requests\n"
        "(an imbalanced instance runs out, the fleet has room), real CPU step times;\n"
        "device = the same KV plus emulated device timing (steps padded to 8 ms + 20 ms x KV\n"
        "occupancy + 0.125 ms per prefilled token), so each instance behaves as its own device.\n"
        "Every number of the device regime is labelled 'emulated device timing'. docs/e2e.md."
    )
    add = parser.add_argument
    add("--regimes", default="memory,device", help="memory and/or device (default %(default)s)")
    add("--modes", default=",".join(MODES), help="scheduler modes (default %(default)s)")
    add(
        "--rates",
        default=None,
        action="append",
        metavar="[REGIME=]RATES",
        help="request rates, req/s, for every regime, or REGIME=RATES for one regime "
        "(repeatable: --rates device=2.5,3 --rates memory=6,8; default: each regime's own sweep, "
        + "; ".join(f"{g} {','.join(f'{r:g}' for r in DEFAULT_RATES[g])}" for g in REGIMES)
        + "; --quick: "
        + ", ".join(f"{g} {QUICK_RATES[g]:g}" for g in REGIMES)
        + ")",
    )
    add("--seeds", default="1,2,3", help="workload seeds (default %(default)s)")
    add("--num-prompts", type=int, default=100, help="requests per cell (default %(default)s)")
    add(
        "--workload",
        default="replay",
        help="replay (ignore_eos, Table-3-shaped lengths), task (natural lengths; no oracle) "
        "or a ShareGPT JSON file (default %(default)s)",
    )
    add(
        "--cap",
        type=int,
        default=1024,
        help="longest answer in tokens: replay's length cap, task/ShareGPT max_tokens (default %(default)s)",
    )
    add("--sizes", default="tiny,short,medium,long,huge", help="task sizes (workload task)")
    add(
        "--kv-requests",
        type=float,
        default=2.0,
        help="memory regime: KV capacity per decode instance, in largest requests "
        "(default %(default)s; the device regime's comes from the card)",
    )
    add(
        "--dilation",
        type=float,
        default=1.0,
        help="device regime: every emulated time and SLO x D, request rates / D, so the CPU "
        "idles in more of each step (default %(default)s: the card's own clock)",
    )
    add(
        "--max-model-len",
        type=int,
        default=None,
        help="engines' max_model_len (default: the longest request, --cap + the prompt "
        "allowance, in whole 128-token blocks)",
    )
    add("--prefill", type=int, default=1, help="prefill workers (default %(default)s)")
    add("--decode", type=int, default=3, help="decode workers (default %(default)s)")
    add("--out", default="build/e2e", help="results directory (default %(default)s)")
    add("--figures", default=None, help="write the figures (PNG) into this directory")
    add(
        "--quick",
        action="store_true",
        help=f"short pass: modes {QUICK['modes']}, one rate per regime (the knee of its sweep), "
        f"seed {QUICK['seeds']}, {QUICK['num_prompts']} requests",
    )
    add("--report-only", action="store_true", help="run nothing: table and figures from --out")
    add("--timeout", type=float, default=300.0, help="per-request read timeout, s")
    add("--no-progress", action="store_true", help="no progress bars")
    add("--json", action="store_true", help="print the comparison's rows as a JSON list")
    add(
        "--predict",
        metavar="FILE",
        default=None,
        help="pre-register: write what star simulate predicts for every cell of this sweep "
        "(and the knee its rule picks) to FILE, with the date and commit, and run nothing; "
        "commit FILE before the fleet runs (benchmarks/e2e/prereg.py)",
    )
    add(
        "--prediction",
        metavar="FILE",
        default=None,
        help="a pre-registration written by --predict: its P99 TPOT beside each result",
    )


def _cells(args: argparse.Namespace) -> list[Cell]:
    regimes, modes = _csv(args.regimes), _csv(args.modes)
    for r in regimes:
        if r not in REGIMES:
            raise ValueError(f"unknown regime {r!r}; expected {', '.join(REGIMES)}")
    for m in modes:
        if m not in MODES:
            raise ValueError(f"unknown mode {m!r}; expected {', '.join(MODES)}")
    if args.rates is None:
        quick = bool(getattr(args, "quick", False))
        per = {g: (QUICK_RATES[g],) if quick else DEFAULT_RATES[g] for g in regimes}
    else:
        per = _rates(args.rates, regimes)
    rates = [r for g in regimes for r in per[g]]
    try:
        seeds = [int(x) for x in _csv(args.seeds)]
    except ValueError:
        raise ValueError(
            f"--seeds takes whole numbers separated by commas, got {args.seeds!r}"
        ) from None
    if not (regimes and modes and rates and seeds):
        raise ValueError("need at least one regime, mode, rate and seed")
    if any(not r > 0 for r in rates):
        raise ValueError(f"rates must be > 0, got {rates}")
    return [Cell(g, m, r, s) for g in regimes for r in per[g] for s in seeds for m in modes]


def _rates(given: str | list[str], regimes: list[str]) -> dict[str, tuple[float, ...]]:
    """Each regime's rates from ``--rates`` values: ``2.5,3`` for every regime,
    ``device=2.5,3`` for one; a regime named nowhere keeps its default sweep."""
    per: dict[str, tuple[float, ...]] = {}
    for text in [given] if isinstance(given, str) else given:
        name, sep, numbers = str(text).rpartition("=")
        name = name.strip()
        if sep and name not in REGIMES:
            raise ValueError(
                f"--rates {text!r}: unknown regime {name!r}; expected {', '.join(REGIMES)}"
            )
        try:
            rates = tuple(float(x) for x in _csv(numbers))
        except ValueError:
            raise ValueError(
                f"--rates takes numbers (req/s) separated by commas, got {text!r}"
            ) from None
        for g in [name] if sep else regimes:
            per[g] = rates
    return {g: per.get(g, DEFAULT_RATES[g]) for g in regimes}


def run(args: argparse.Namespace) -> int:
    if args.quick:
        for key, value in QUICK.items():
            setattr(args, key, value)
    out = Path(args.out)
    if args.max_model_len is None:
        args.max_model_len = default_max_model_len(args.cap)
    try:
        if args.predict:
            return _predict(args)
        cells = _cells(args)
        for name in {c.regime for c in cells}:  # a regime that cannot run says so before any fleet
            regime(name, args.cap, args.kv_requests, args.max_model_len, args.dilation)
        if not args.report_only:
            _one_shape(out, cluster_name(args.prefill, args.decode))
    except ValueError as exc:
        print(f"bench e2e: {exc}", file=sys.stderr)
        return 2
    if not args.report_only:
        from star.fleet import Terminated

        try:
            code = _run_cells(args, cells, out)
        except (KeyboardInterrupt, Terminated):
            print(f"bench e2e: interrupted; finished cells are kept in {out}", file=sys.stderr)
            return 130
        if code:
            return code
    docs = [d for d in load_all(out) if cell_of(d) in cells]
    if not docs:
        print(f"bench e2e: no finished cells under {out}", file=sys.stderr)
        return 1
    if not args.json:
        _resimulate(docs, out)
    rows = [row(d) for d in docs]
    compared = comparison_rows([(d, load_requests(out, cell_of(d))) for d in docs])
    if args.prediction:
        from benchmarks.e2e.prereg import load, predicted_p99

        ran: dict[tuple[str, str, float, str], list[int]] = {}
        for d in docs:
            ran.setdefault(group_of(d), []).append(int(d["row"]["seed"]))
        predicted = predicted_p99(load(Path(args.prediction)), lambda key: ran.get(key, []))
        for c in compared:
            key = (c["regime"], c["cluster"], c["rate"], c["mode"])
            c["predicted_p99_tpot_ms"] = predicted.get(key)
    if args.figures:
        from benchmarks.e2e.figures import draw_all

        for path in draw_all(docs, Path(args.figures)):
            print(f"bench e2e: wrote {path}", file=sys.stderr)
    if args.json:
        for c in compared:  # each comparison row carries the rows of its cells
            group = (c["regime"], c["cluster"], c["rate"], c["mode"])
            c["cells"] = [r for r, d in zip(rows, docs, strict=True) if group_of(d) == group]
        print(json.dumps(_plain(compared), indent=1, allow_nan=False))
    else:
        print(comparison_table(compared))
        for line in _emulation_notes(docs):
            print(line)
        print()
        print(table(aggregate(rows)))
        print()
        print(sim_table(docs))
        print()
        print(live_table(docs))
    return 0


def _predict(args: argparse.Namespace) -> int:
    """``--predict FILE``: the pre-registration of this sweep (see benchmarks/e2e/prereg.py)."""
    from benchmarks.e2e import prereg
    from benchmarks.e2e.regimes import bytes_per_token
    from benchmarks.e2e.workload import Workload
    from proxy.tokenizer import ModelCard
    from star.model import tiny_model_path

    model = Path(tiny_model_path())
    card = ModelCard.load(model, "star-tiny")

    def count(prompt: Any) -> int:
        return len(card.encode(prompt) if isinstance(prompt, str) else card.encode_chat(prompt))

    workload = Workload(args.workload, tuple(_csv(args.sizes)), args.cap)
    cells = _cells(args)
    rows = prereg.predict(
        cells,
        workload,
        count,
        num_prompts=args.num_prompts,
        kv_requests=args.kv_requests,
        max_model_len=args.max_model_len,
        dilation=args.dilation,
        prefill=args.prefill,
        decode=args.decode,
        bytes_per_token=bytes_per_token(model),
    )
    design = {
        "argv": sys.argv[1:],
        "workload": workload.name,
        "cap": workload.cap,
        "num_prompts": args.num_prompts,
        "prefill": args.prefill,
        "decode": args.decode,
        "cells": len(cells),
    }
    doc = prereg.write(Path(args.predict), rows, design)
    print(f"bench e2e: pre-registered {len(rows)} cells in {args.predict}", file=sys.stderr)
    for reg, knee in doc["knee"].items():
        print(f"bench e2e: knee of {reg} by the rule: {knee if knee is not None else 'none'}")
    return 0


def cell_line(cell: Cell, row: dict[str, Any]) -> str:
    """The line a finished cell prints: its outcome, failures and, on emulated timing,
    its padding (the share of each step the CPU idled: a cell's validity, docs/e2e.md)."""
    line = (
        f"{cell.regime} {cell.mode} rate {cell.rate:g} seed {cell.seed}: "
        f"P99 TPOT {row['p99_tpot_ms']:.1f} ms, goodput {row['goodput']:.2f} req/s, "
        f"preemptions {row['preemptions']}, migrations {row['migrations']}"
    )
    if row.get("failed"):
        line += f", {row['failed']} of {row['requests']} failed"
    if row.get("pad_share"):
        line += f", padding {row['pad_share']:.0%}"
    return line


def _emulation_notes(docs: list[dict[str, Any]]) -> list[str]:
    """One line per emulated regime: its card, factors and the padding measured."""
    notes: dict[str, tuple[dict[str, Any], list[float]]] = {}
    for d in docs:
        emu = d["config"]["regime"].get("emulation")
        if emu:
            entry = notes.setdefault(d["row"]["regime"], (emu, []))
            if d["row"].get("pad_share") is not None:
                entry[1].append(float(d["row"]["pad_share"]))
    return [
        f"{reg}: emulated device timing, {emu['card']}; compression {emu['compression']:g} "
        f"(KV {emu['kv_tokens']} tokens, step {emu['step_ms']}, prefill "
        f"{emu['prefill_us_per_token']:g} us/token, KV pull {emu['transfer_us_per_token']:g} "
        f"us/token), dilation {emu['dilation']:g}; the CPU idled in "
        f"{sum(pads) / len(pads):.0%} of each step (padding)"
        for reg, (emu, pads) in notes.items()
        if pads
    ]


def _plain(value: Any) -> Any:
    """``value`` with NaN (no value: JSON has no word for it) as None, recursively."""
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return value


def _resimulate(docs: list[dict[str, Any]], out: Path) -> None:
    """Each cell's sim-to-real run again, with the simulator of this tree and one
    migration stall per regime (the median over all its cells' migrations)."""
    from benchmarks.e2e.simreal import pooled_stall_s, simulate_cell

    stalls = pooled_stall_s(docs)
    for d in docs:
        records = load_requests(out, cell_of(d))
        if records:
            d["sim"] = simulate_cell(d, records, stalls.get(d["row"]["regime"]))


def _one_shape(out: Path, shape: str) -> None:
    """Refuse to add cells of fleet shape ``shape`` to a results directory holding
    another shape's: a finished cell is found by regime, mode, rate and seed, so
    it would be taken for this shape's and skipped."""
    other = sorted({cluster_of(d) for d in load_all(out)} - {shape})
    if other:
        raise ValueError(
            f"{out} holds cells of a {', '.join(other)} fleet and this run is {shape}: "
            "give each fleet shape its own --out"
        )


def _run_cells(args: argparse.Namespace, cells: list[Cell], out: Path) -> int:
    from tqdm import tqdm

    from benchmarks.e2e.cell import document
    from benchmarks.e2e.fleet import run_cell
    from benchmarks.e2e.prereg import source_tree
    from benchmarks.e2e.regimes import bytes_per_token, regime
    from benchmarks.e2e.simreal import simulate_cell
    from benchmarks.e2e.workload import Workload, schedule
    from star.model import tiny_model_path

    workload = Workload(args.workload, tuple(_csv(args.sizes)), args.cap)
    model = Path(tiny_model_path())
    bpt = bytes_per_token(model)
    todo = [c for c in cells if load_cell(out, c) is None]
    skipped = [c for c in todo if c.mode == "oracle" and not workload.known_lengths]
    for c in skipped:
        print(
            f"bench e2e: skipping {c}: oracle needs known final lengths "
            f"(workload {workload.name!r} has natural lengths; use replay or a ShareGPT file)",
            file=sys.stderr,
        )
    todo = [c for c in todo if c not in skipped]
    if len(todo) < len(cells):
        print(
            f"bench e2e: {len(cells) - len(todo)} of {len(cells)} cells already done in {out}",
            file=sys.stderr,
        )
    count = _token_counter(model) if workload.name not in ("task", "replay") else None
    tree = source_tree()  # what each cell ran: its commit, and whether the tree differed from it
    bar = tqdm(todo, unit="cell", disable=args.no_progress or not todo, file=sys.stderr)
    failed = 0
    for cell in bar:
        bar.set_description(f"{cell.regime} {cell.mode} rate {cell.rate:g} seed {cell.seed}")
        reg = regime(cell.regime, workload.cap, args.kv_requests, args.max_model_len, args.dilation)
        # Rates are the device's: a dilated clock sends 1/d as many per wall second.
        rate = cell.rate / reg.dilation
        requests, times = schedule(workload, args.num_prompts, rate, cell.seed, count)
        logs = Path(tempfile.mkdtemp(prefix="star-e2e-"))
        started = time.monotonic()
        try:
            res = run_cell(
                reg,
                cell.mode,
                requests,
                times,
                workload.extra,
                prefill=args.prefill,
                decode=args.decode,
                run_dir=logs,
                bytes_per_token=bpt,
                timeout_s=args.timeout,
                progress=not args.no_progress,
            )
        except Exception as exc:
            # The other cells still run; a later run retries this one.
            bar.write(
                f"bench e2e: {cell} failed: {exc}; fleet logs kept in {logs}", file=sys.stderr
            )
            failed += 1
            continue
        doc, rows = document(
            cell,
            workload.name,
            reg,
            res,
            {
                "num_prompts": args.num_prompts,
                "cap": workload.cap,
                "prefill": args.prefill,
                "decode": args.decode,
                "bytes_per_token": bpt,
                "wall_s": time.monotonic() - started,
                **tree,
            },
        )
        doc["sim"] = simulate_cell(doc, rows)
        write_cell(out, cell, doc, rows)
        shutil.rmtree(logs, ignore_errors=True)
        bar.write(cell_line(cell, doc["row"]), file=sys.stderr)
    if failed:
        print(
            f"bench e2e: {failed} of {len(todo)} cells failed; run again to retry them",
            file=sys.stderr,
        )
        return 1
    return 0


def _token_counter(model: Path) -> Any:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(model / "tokenizer.json"))
    return lambda text: len(tok.encode(text).ids)
