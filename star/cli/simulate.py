"""``star simulate``: the cluster simulator, one run or a sweep (paper §6.3).

    star simulate --instances 8,16,32,64,128,256 \\
        --modes no-migration,current,predicted,oracle --seeds 1,2,3 \\
        --tables bins,interval --out build/sim --figures docs/img

runs every (instances, mode, seed) on a pool of ``--jobs`` processes, prints
the table of means over seeds, and with ``--out`` writes ``results.csv``,
``results.json``, ``summary.md`` and the figures (Fig. 10 variance vs
cluster size, variance over time, Fig. 12 KV usage with migration ticks).
``--tables`` adds the paper's Table 4 (bins) and Table 5 (prediction
interval) studies. ``--json`` prints the rows as a JSON list.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from star.planner.types import PARAM_RULES, Mode, PlannerParams
from star.rules import Rule
from star.settings import add_setting_flag, load_settings
from star.sim import report
from star.sim.config import PREDICTORS, RULES_BY_FIELD, ConfigError, SimConfig
from star.sim.metrics import ROW_KEYS, SimResult
from star.sim.sweep import sweep
from star.sim.workload import SYNTHETIC, Workload, WorkloadError, load

ALL_MODES = "no-migration,current,predicted,oracle"

# Paper Table 4 ("Prediction accuracy sensitivity") and Table 5
# ("Prediction-interval tradeoff"): (setting key, label, mode, k).
BINS_STUDY: tuple[tuple[str, str, str, int], ...] = (
    ("full", "Full", "predicted", 20),
    ("bins:6", "6-bin", "bins:6", 20),
    ("bins:4", "4-bin", "bins:4", 20),
    ("bins:2", "2-bin", "bins:2", 20),
    ("no-pred", "No pred.", "current", 20),
)
INTERVAL_STUDY: tuple[tuple[str, str, str, int], ...] = (
    ("k=1", "1 iter", "predicted", 1),
    ("full", "20 iter", "predicted", 20),
    ("k=100", "100 iter", "predicted", 100),
    ("no-pred", "No pred.", "current", 20),
)
STUDIES = {"bins": BINS_STUDY, "interval": INTERVAL_STUDY}
TABLE_RATE_PER_8 = 0.5

# The flags that mirror a setting, made from its metadata (star.settings.add_setting_flag):
# (flag, setting, metavar, default from the loaded settings rather than the setting's default).
MIRRORED: tuple[tuple[str, str, str | None, bool], ...] = (
    ("--duration", "simulator.duration_s", "S", True),
    ("--rate-per-8", "simulator.rate_per_8", "RPS", True),
    ("--tick", "simulator.tick_s", "S", True),
    ("--bandwidth-gbps", "simulator.bandwidth_gbps", "G", True),
    ("--dispatch", "scheduler.dispatch", None, False),
    ("--predict-every", "predictor.every_k", "K", False),
    ("--max-migrations", "scheduler.max_migrations", "M", False),
)


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the ``simulate`` subcommand."""
    d = SimConfig()
    p = subparsers.add_parser(
        "simulate",
        help="simulate a PD-disaggregated cluster under each rescheduling mode",
        description=(
            "Discrete-event simulation of prefill and decode instances with continuous "
            "batching, KV capacity and preemption, calling the live planner every tick "
            "(paper §6.3). Lists are comma-separated; every combination runs."
        ),
    )
    p.add_argument(
        "--instances",
        default=str(d.decode_instances),
        metavar="LIST",
        help="decode instances per run (default %(default)s)",
    )
    p.add_argument(
        "--modes",
        default=ALL_MODES,
        metavar="LIST",
        help="no-migration, current, predicted, oracle, bins:K (default: all four)",
    )
    p.add_argument("--seeds", default=str(d.seed), metavar="LIST", help="(default %(default)s)")
    p.add_argument(
        "--rate",
        type=float,
        default=0.0,
        metavar="RPS",
        help="arrival rate; default scales with size: --rate-per-8 x instances / 8",
    )
    p.add_argument(
        "--workload",
        default=d.workload,
        metavar="NAME|PATH",
        help=f"synthetic {' or '.join(SYNTHETIC)} (Table 2), or a ShareGPT/Alpaca "
        "JSON or JSON-lines trace file (default %(default)s)",
    )
    p.add_argument(
        "--workload-format", default="auto", choices=("auto", "sharegpt", "alpaca", "trace")
    )
    p.add_argument(
        "--predictor",
        default=d.predictor,
        choices=PREDICTORS,
        help="what predicted and bins:K modes see (default %(default)s)",
    )
    p.add_argument(
        "--warmup",
        type=float,
        default=d.warmup_s,
        metavar="S",
        help="metrics ignore the first S seconds (default %(default)s)",
    )
    p.add_argument(
        "--capacity",
        type=int,
        default=d.kv_capacity_tokens,
        metavar="TOKENS",
        help="KV capacity per decode instance (default %(default)s)",
    )
    mirrored = p.add_argument_group(
        "flags that mirror a setting",
        "type, bounds and help as in `star config show`; the simulator.* ones default "
        "to the settings ($STAR_CONFIG file, STAR_SIMULATOR_*), the others to the setting's default",
    )
    for flag, key, metavar, from_settings in MIRRORED:
        add_setting_flag(mirrored, flag, key, metavar=metavar, from_settings=from_settings)
    p.add_argument(
        "--set",
        dest="set_",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="any other SimConfig field, or planner.FIELD (e.g. planner.theta=0.2)",
    )
    p.add_argument(
        "--tables",
        default="",
        metavar="LIST",
        help="also run the paper's studies: bins (Table 4), interval (Table 5)",
    )
    p.add_argument(
        "--table-instances",
        type=int,
        default=64,
        metavar="N",
        help="decode instances of the --tables runs (default %(default)s)",
    )
    p.add_argument(
        "--table-rate-per-8",
        type=float,
        default=TABLE_RATE_PER_8,
        metavar="RPS",
        help="arrivals per second per 8 instances in the --tables runs (default %(default)s: "
        "vLLM fills its KV and preempts, STAR does not, as in the paper's Fig. 12)",
    )
    p.add_argument(
        "--trace-instances",
        type=int,
        default=0,
        metavar="N",
        help="cluster size of the over-time figures (default: the smallest)",
    )
    p.add_argument(
        "--jobs",
        type=int,
        default=2,
        metavar="N",
        help="worker processes (default %(default)s; 1 runs in process)",
    )
    p.add_argument("--out", metavar="DIR", help="write results.csv, results.json, summary.md")
    p.add_argument("--figures", metavar="DIR", help="write the PNG figures here (default: --out)")
    p.add_argument(
        "--figure-prefix",
        default="sim",
        metavar="NAME",
        help="figure file names start with this (default %(default)s)",
    )
    p.add_argument("--json", action="store_true", help="print the rows as a JSON list")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=run)


def _ints(text: str, what: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ConfigError(f"--{what} {text!r}: expected comma-separated integers") from None
    if not values:
        raise ConfigError(f"--{what} is empty")
    return values


def _coerce(name: str, text: str, rule: Rule) -> Any:
    try:
        return rule.parse(text)
    except ValueError as exc:
        raise ConfigError(f"--set {name}={text!r}: {exc}") from None


def apply_sets(base: SimConfig, assignments: Sequence[str]) -> SimConfig:
    """``KEY=VALUE`` overrides of SimConfig fields and ``planner.FIELD``."""
    sim_fields = {f.name for f in dataclasses.fields(SimConfig)}
    plan_fields = {f.name for f in dataclasses.fields(PlannerParams)}
    changes: dict[str, Any] = {}
    planner: dict[str, Any] = {}
    for text in assignments:
        key, sep, value = text.partition("=")
        key = key.strip()
        if not sep:
            raise ConfigError(f"--set {text!r}: expected KEY=VALUE")
        if key.startswith("planner."):
            name = key.removeprefix("planner.")
            if name not in plan_fields or name == "mode":
                raise ConfigError(f"--set {key}: unknown planner field (use --modes for the mode)")
            planner[name] = _coerce(key, value, PARAM_RULES[name])
        elif key in sim_fields and key != "planner":
            changes[key] = _coerce(key, value, RULES_BY_FIELD[key])
        else:
            raise ConfigError(
                f"--set {key}: unknown simulator field; one of {', '.join(sorted(sim_fields))}"
            )
    if planner:
        changes["planner"] = dataclasses.replace(base.planner, **planner)
    return dataclasses.replace(base, **changes) if changes else base


def build_base(args: argparse.Namespace) -> SimConfig:
    """The SimConfig every run starts from (flags, then --set)."""
    workload = args.workload if args.workload in SYNTHETIC else SimConfig().workload
    base = SimConfig(
        duration_s=args.duration,
        rate_rps=args.rate,
        rate_per_8=args.rate_per_8,
        workload=workload,
        dispatch=args.dispatch,
        predictor=args.predictor,
        predict_every=args.predict_every,
        tick_s=args.tick,
        warmup_s=args.warmup,
        kv_capacity_tokens=args.capacity,
        bandwidth_gbps=args.bandwidth_gbps,
        planner=dataclasses.replace(PlannerParams(), max_migrations=args.max_migrations),
    )
    return apply_sets(base, args.set_)


def plan_runs(
    args: argparse.Namespace, base: SimConfig
) -> tuple[list[SimConfig], list[tuple[str, str, int]]]:
    """Distinct configs to run, and (setting, mode, config index) for every row."""
    configs: list[SimConfig] = []
    index: dict[SimConfig, int] = {}
    rows: list[tuple[str, str, int]] = []

    def add(setting: str, cfg: SimConfig) -> None:
        if cfg not in index:
            index[cfg] = len(configs)
            configs.append(cfg)
        rows.append((setting, cfg.mode, index[cfg]))

    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    for mode in modes:
        Mode.parse(mode)
    seeds = _ints(args.seeds, "seeds")
    for n in _ints(args.instances, "instances"):
        for mode in modes:
            for seed in seeds:
                add("sweep", dataclasses.replace(base, decode_instances=n, mode=mode, seed=seed))
    studies = [s.strip() for s in args.tables.split(",") if s.strip()]
    for study in studies:
        if study not in STUDIES:
            raise ConfigError(f"--tables {study!r}: expected {', '.join(STUDIES)}")
        for key, _, mode, k in STUDIES[study]:
            for seed in seeds:
                cfg = dataclasses.replace(
                    base,
                    decode_instances=args.table_instances,
                    mode=mode,
                    seed=seed,
                    predict_every=k,
                    rate_per_8=args.table_rate_per_8,
                    rate_rps=0.0,
                )
                add(f"{study}:{key}", cfg)
    return configs, rows


def _apply_settings(args: argparse.Namespace) -> None:
    """Flags not given take the [simulator] settings ($STAR_CONFIG file, STAR_SIMULATOR_*).

    (This command's own ``--set`` sets simulator fields directly, not settings keys.)
    """
    settings = load_settings()
    for flag, key, _metavar, from_settings in MIRRORED:
        dest = flag.removeprefix("--").replace("-", "_")
        if from_settings and getattr(args, dest) is None:
            area, name = key.split(".")
            setattr(args, dest, getattr(getattr(settings, area), name))


def run(args: argparse.Namespace) -> int:
    """Run the simulations, print and write the results."""
    _apply_settings(args)
    try:
        base = build_base(args)
        configs, plan_rows = plan_runs(args, base)
        source = load(args.workload, args.workload_format)
    except (ConfigError, WorkloadError, ValueError) as exc:
        print(f"star: error: {exc}", file=sys.stderr)
        return 2
    workload = source if isinstance(source, Workload) else None
    started = time.perf_counter()
    results = sweep(
        configs, workload, jobs=max(1, args.jobs), progress=False if args.no_progress else None
    )
    wall = time.perf_counter() - started

    rows = [dict(results[i].row, setting=setting) for setting, _, i in plan_rows]
    has_tables = any(setting != "sweep" for setting, _, _ in plan_rows)
    if args.json:
        keys = (*ROW_KEYS, "setting") if has_tables else ROW_KEYS
        json.dump([{k: r[k] for k in keys} for r in rows], sys.stdout)
        sys.stdout.write("\n")
    else:
        print(render_summary(rows, args), end="")
        cpu = sum(float(r.row["cpu_seconds"]) for r in results)
        print(
            f"\n{len(configs)} runs in {wall:.1f} s wall on {max(1, args.jobs)} process(es), "
            f"{cpu:.1f} s CPU in the runs"
        )
    if args.out or args.figures:
        return write_outputs(args, rows, results, plan_rows)
    return 0


def render_summary(rows: Sequence[dict[str, Any]], args: argparse.Namespace) -> str:
    """The markdown tables printed and written to summary.md."""
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    agg = report.aggregate(rows)
    sweep_agg = [a for a in agg if a["setting"] == "sweep"]
    parts = []
    if sweep_agg:
        parts.append(report.sweep_table(sweep_agg, modes))
    for study, spec in STUDIES.items():
        mine = [
            dict(a, setting=a["setting"].split(":", 1)[1])
            for a in agg
            if str(a["setting"]).startswith(study + ":")
        ]
        if mine:
            title = "Table 4 (bins)" if study == "bins" else "Table 5 (prediction interval)"
            n = mine[0]["instances"]
            parts.append(
                f"\n{title}, {n} decode instances, {args.table_rate_per_8 * n / 8:g} req/s, "
                f"{len(_ints(args.seeds, 'seeds'))} seed(s)\n\n"
                + report.study_table(mine, [(k, label) for k, label, _, _ in spec])
            )
    return "".join(parts)


def figure_title(args: argparse.Namespace) -> str:
    """Fig. 10's title with the settings that shape it."""
    rate = f"{args.rate:g} req/s" if args.rate else f"{args.rate_per_8:g} req/s per 8 instances"
    return (
        f"Execution-time variance vs cluster size\n"
        f"tick {args.tick:g} s, M = {args.max_migrations}, {rate}, {args.duration:g} s"
    )


def write_outputs(
    args: argparse.Namespace,
    rows: list[dict[str, Any]],
    results: list[SimResult],
    plan_rows: list[tuple[str, str, int]],
) -> int:
    """CSV, JSON, summary and figures."""
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        report.write_csv(rows, out / "results.csv")
        report.write_json(rows, out / "results.json")
        (out / "summary.md").write_text(render_summary(rows, args), encoding="utf-8")
    fig_dir = Path(args.figures or args.out)
    fig_dir.mkdir(parents=True, exist_ok=True)
    sweep_rows = [r for r in rows if r["setting"] == "sweep"]
    if not sweep_rows:
        return 0
    try:
        agg = report.aggregate(sweep_rows)
        if len({a["instances"] for a in agg}) > 1:
            report.plot_variance_vs_size(
                agg,
                fig_dir / f"{args.figure_prefix}-variance-vs-size.png",
                title=figure_title(args),
            )
        sizes = sorted({r["instances"] for r in sweep_rows})
        size = args.trace_instances if args.trace_instances in sizes else sizes[0]
        seed = min(r["seed"] for r in sweep_rows)
        picked: dict[str, SimResult] = {}
        for setting, mode, i in plan_rows:
            res = results[i]
            if setting == "sweep" and res.row["instances"] == size and res.row["seed"] == seed:
                picked.setdefault(mode, res)
        order = [m for m in report.MODE_LABELS if m in picked] + [
            m for m in picked if m not in report.MODE_LABELS
        ]
        traces = [picked[m] for m in order]
        report.plot_variance_over_time(
            traces, fig_dir / f"{args.figure_prefix}-variance-over-time.png"
        )
        report.plot_kv_usage(traces, fig_dir / f"{args.figure_prefix}-kv-usage.png")
    except report.PlotUnavailable as exc:
        print(f"star: warning: no figures: {exc}", file=sys.stderr)
    return 0
