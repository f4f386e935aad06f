"""``star plan``: what the rescheduler would decide for a cluster state, and why.

For the operator asking "why did (or didn't) it migrate": the classification
with every instance's workload, each (request, source, target) the planner
considered with its Delta-V and verdict, and the chosen moves (paper
Algorithm 1, one tick). The state is the JSON of ``docs/plan-state.md``.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections import Counter
from collections.abc import Sequence
from typing import Any, TextIO

from star.planner import Instance, Plan, PlannerParams, Verdict, plan, remaining_for
from star.planner.state import instances_from_state, params_from_dict
from star.planner.trace import instance_traces
from star.planner.types import ModeKind, Request
from star.settings import add_setting_flag

_VERDICT_ORDER = {v: i for i, v in enumerate(Verdict)}


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the ``plan`` subcommand."""
    p = subparsers.add_parser(
        "plan",
        help="show what the rescheduler would decide for a cluster state, and why",
        description=(
            "Run one scheduler tick (paper Algorithm 1) on a cluster state and explain it: "
            "instance classification, every candidate migration with its ΔV and verdict, "
            "the chosen moves. Parameters: defaults < the file's params < --mode/--set."
        ),
    )
    p.add_argument(
        "--input",
        "-i",
        metavar="STATE.json",
        help="cluster state ('-' for stdin); schema in docs/plan-state.md",
    )
    p.add_argument(
        "--from-redis",
        action="store_true",
        help=(
            "use the live state as the scheduler sees it: the newest fresh report of "
            "every instance, less those whose worker announced worker_down, with the "
            "migrations not yet resolved booked, and the scheduler's parameters "
            "([scheduler] settings)"
        ),
    )
    p.add_argument(
        "--config",
        metavar="PATH",
        help="STAR TOML config (with --from-redis; default $STAR_CONFIG)",
    )
    # scheduler.mode's flag: parsed and checked by the setting's rule, as star scheduler's.
    add_setting_flag(
        p,
        "--mode",
        "scheduler.mode",
        metavar="MODE",
        from_settings=True,
        note="Overrides the state's params.mode (--from-redis: the settings'), which overrides the default",
    )
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a planner parameter, e.g. --set theta=0.2 --set max_migrations=2",
    )
    p.add_argument("--json", action="store_true", help="print the decision as JSON")
    p.add_argument(
        "--limit",
        type=int,
        default=20,
        metavar="N",
        help="candidates shown in the table, best ΔV first (0: all; default 20)",
    )
    p.set_defaults(func=run)


def load_state(args: argparse.Namespace) -> tuple[list[Instance], PlannerParams]:
    """Instances and parameters from ``--input`` and the overriding flags.

    Raises ValueError or OSError with a message fit for the operator.
    """
    if args.from_redis:
        if args.input:
            raise ValueError("give either --input or --from-redis, not both")
        return _live_state(args)
    if not args.input:
        raise ValueError("--input STATE.json or --from-redis is required")
    if args.input == "-":
        doc = json.load(sys.stdin)
    else:
        with open(args.input, encoding="utf-8") as f:
            doc = json.load(f)
    instances, overrides = instances_from_state(doc)
    return instances, params_from_dict(_overrides(overrides, args))


def _live_state(args: argparse.Namespace) -> tuple[list[Instance], PlannerParams]:
    """The scheduler's view rebuilt from the bus (:func:`scheduler.service.read_view`)."""
    import asyncio

    from scheduler.service import read_view
    from star.bus import BusUnavailable
    from star.settings import load_settings

    settings = load_settings(args.config)
    params = params_from_dict(_overrides({}, args), base=PlannerParams.from_settings(settings))
    try:
        view = asyncio.run(read_view(settings))
    except BusUnavailable as exc:
        raise ValueError(str(exc)) from None
    instances = view.instances(params)
    if not instances:
        raise ValueError(
            f"no fresh decode reports on {settings.bus.prefix}:reports "
            f"(newer than scheduler.staleness_s={settings.scheduler.staleness_s}s)"
        )
    return instances, params


def _overrides(base: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    out = dict(base)
    for item in args.set:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"--set {item!r}: expected KEY=VALUE")
        out[key.strip()] = value
    if args.mode:
        out["mode"] = args.mode
    return out


def run(args: argparse.Namespace) -> int:
    """Entry point of ``star plan``; the exit status is 2 on bad input."""
    try:
        instances, params = load_state(args)
    except json.JSONDecodeError as exc:
        print(f"star plan: {args.input}: not JSON: {exc}", file=sys.stderr)
        return 2
    except (OSError, ValueError) as exc:
        print(f"star plan: {exc}", file=sys.stderr)
        return 2
    result = plan(instances, params, explain=True)
    if args.json:
        json.dump(plan_to_json(result, instances, params), sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        render_text(result, instances, params, sys.stdout, limit=args.limit)
    return 0


def reason(result: Plan, params: PlannerParams, draining: Sequence[str] = ()) -> str:
    """One sentence on why this tick migrates what it does, or nothing.

    ``draining``: the instances that are (never underloaded, so never a target).
    """
    if result.moves:
        n = len(result.moves)
        return f"{n} migration{'s' if n > 1 else ''} lower the weighted variance V"
    if params.mode.kind is ModeKind.NO_MIGRATION:
        return "mode no-migration never migrates (P->D dispatch only)"
    if not result.workloads:
        return "no decode instances"
    if not result.overloaded:
        peak = max(result.workloads.values())
        ratio = peak / result.mean_workload if result.mean_workload > 0 else 0.0
        return (
            f"no instance is overloaded: the highest workload is {ratio:.3f} x the mean, "
            f"not above 1 + theta = {1 + params.theta:.3f}"
        )
    if not result.underloaded:
        if draining:
            return (
                "no instance is underloaded (draining ones never are: "
                f"{', '.join(draining)}) and every other current load is at least "
                "(1 + theta) x mean"
            )
        return "no instance is underloaded: every current load is at least (1 + theta) x mean"
    if not result.candidates:
        return "no candidate: no underloaded instance other than the overloaded source"
    counts = Counter(c.verdict for c in result.candidates)
    if counts[Verdict.NOT_BEST] == 0 and counts[Verdict.NO_GAIN] > 0:
        return (
            f"no feasible candidate lowers V by more than min_gain = {params.min_gain:g} "
            f"({counts[Verdict.NO_GAIN]} feasible, none with gain)"
        )
    blocked = ", ".join(f"{counts[v]} {v.value}" for v in Verdict if counts[v])
    return f"every candidate was filtered out ({blocked})"


def _draining(instances: Sequence[Instance]) -> list[str]:
    return [inst.id for inst in instances if inst.draining]


def _requests_by_key(instances: list[Instance]) -> dict[tuple[str, str], Request]:
    return {(inst.id, r.id): r for inst in instances for r in inst.requests}


def _finite(x: float) -> float | None:
    return x if math.isfinite(x) else None


def plan_to_json(result: Plan, instances: list[Instance], params: PlannerParams) -> dict[str, Any]:
    """The decision as a JSON-ready dict (infinite R-hat becomes null)."""
    loads = instance_traces(instances, params)[:, 0].tolist()
    over, under = set(result.overloaded), set(result.underloaded)
    reqs = _requests_by_key(instances)
    return {
        "mode": str(params.mode),
        "params": {
            "horizon": params.horizon,
            "delta": params.delta,
            "beta_decay": params.beta_decay,
            "theta": params.theta,
            "min_gain": params.min_gain,
            "max_migrations": params.max_migrations,
            "bandwidth_bytes_per_s": params.bandwidth_bytes_per_s,
            "handoff_latency_s": params.handoff_latency_s,
            "default_step_time_s": params.default_step_time_s,
            "transfer_budget_s": params.transfer_budget_s,
        },
        "mean_workload": result.mean_workload,
        "instances": [
            {
                "id": inst.id,
                "overloaded": inst.id in over,
                "underloaded": inst.id in under,
                "in_flight": inst.in_flight,
                "draining": inst.draining,
                "requests": len(inst.requests),
                "load_now": loads[i],
                "workload": result.workloads[inst.id],
                "capacity_tokens": inst.capacity_tokens,
            }
            for i, inst in enumerate(instances)
        ],
        "overloaded": list(result.overloaded),
        "underloaded": list(result.underloaded),
        "candidates": [
            {
                "request": c.request,
                "source": c.source,
                "target": c.target,
                "tokens": reqs[(c.source, c.request)].tokens,
                "remaining": _finite(
                    remaining_for(
                        reqs[(c.source, c.request)], params.mode, params.bins_scale_tokens
                    )
                ),
                "delta_v": c.delta_v,
                "verdict": c.verdict.value,
            }
            for c in result.candidates
        ],
        "moves": [
            {
                "request": m.request,
                "source": m.source,
                "target": m.target,
                "delta_v": m.delta_v,
                "tokens": m.tokens,
                "remaining": _finite(m.remaining),
            }
            for m in result.moves
        ],
        "variance_before": result.variance_before,
        "variance_after": result.variance_after,
        "reason": reason(result, params, _draining(instances)),
    }


def _table(rows: list[list[str]], right: set[int], out: TextIO) -> None:
    widths = [max(len(row[c]) for row in rows) for c in range(len(rows[0]))]
    for row in rows:
        cells = [
            cell.rjust(widths[c]) if c in right else cell.ljust(widths[c])
            for c, cell in enumerate(row)
        ]
        out.write("  ".join(cells).rstrip() + "\n")


def _tokens(x: float) -> str:
    return f"{x:,.0f}" if math.isfinite(x) else "inf"


def _remaining(x: float, params: PlannerParams) -> str:
    if params.mode.kind in (ModeKind.CURRENT, ModeKind.NO_MIGRATION):
        return "-"  # the mode does not look at remaining lengths
    return _tokens(x) if math.isfinite(x) else "unknown"


def render_text(
    result: Plan,
    instances: list[Instance],
    params: PlannerParams,
    out: TextIO,
    *,
    limit: int = 20,
) -> None:
    """The human-readable report of ``star plan``."""
    n = len(instances)
    horizon = 0 if params.mode.kind in (ModeKind.CURRENT, ModeKind.NO_MIGRATION) else params.horizon
    out.write(
        f"mode {params.mode}: {n} decode instance{'s' if n != 1 else ''}, "
        f"H={horizon} x delta={params.delta} steps, theta={params.theta:g}, "
        f"min_gain={params.min_gain:g}, max_migrations={params.max_migrations}\n"
    )
    if not instances:
        out.write(f"decision: nothing to do ({reason(result, params, _draining(instances))})\n")
        return
    bound = (1 + params.theta) * result.mean_workload
    out.write(
        f"mean workload {_tokens(result.mean_workload)} tokens; "
        f"overloaded: w > {_tokens(bound)}; underloaded: L(0) < {_tokens(bound)}\n\n"
    )
    loads = instance_traces(instances, params)[:, 0]
    over, under = set(result.overloaded), set(result.underloaded)
    rows = [["instance", "class", "requests", "L(0)", "w", "w/mean", "capacity", "note"]]
    for i, inst in enumerate(instances):
        cls = "O" if inst.id in over else "U" if inst.id in under else "-"
        if inst.id in over and inst.id in under:
            cls = "O,U"
        w = result.workloads[inst.id]
        ratio = w / result.mean_workload if result.mean_workload > 0 else 0.0
        rows.append(
            [
                inst.id,
                cls,
                str(len(inst.requests)),
                _tokens(float(loads[i])),
                _tokens(w),
                f"{ratio:.3f}",
                _tokens(inst.capacity_tokens),
                ", ".join(
                    note
                    for note, on in (("in flight", inst.in_flight), ("draining", inst.draining))
                    if on
                ),
            ]
        )
    _table(rows, {2, 3, 4, 5, 6}, out)

    cands = result.candidates
    if cands:
        counts = Counter(c.verdict for c in cands)
        summary = ", ".join(f"{counts[v]} {v.value}" for v in Verdict if counts[v])
        out.write(f"\ncandidates (r, s, t) considered: {len(cands)} ({summary})\n")
        ranked = sorted(
            cands,
            key=lambda c: (
                c.verdict is not Verdict.CHOSEN,
                c.delta_v if c.delta_v is not None else math.inf,
                _VERDICT_ORDER[c.verdict],
            ),
        )
        shown = ranked if limit <= 0 else ranked[:limit]
        reqs = _requests_by_key(instances)
        rows = [["source", "target", "request", "tokens", "remaining", "ΔV", "verdict"]]
        for c in shown:
            r = reqs[(c.source, c.request)]
            dv = "" if c.delta_v is None else f"{c.delta_v:.4g}"
            rows.append(
                [
                    c.source,
                    c.target,
                    c.request,
                    _tokens(r.tokens),
                    _remaining(remaining_for(r, params.mode, params.bins_scale_tokens), params),
                    dv,
                    c.verdict.value,
                ]
            )
        _table(rows, {3, 4, 5}, out)
        if len(shown) < len(ranked):
            out.write(f"... {len(ranked) - len(shown)} more (--limit 0 shows all)\n")

    out.write("\n")
    if result.moves:
        for m in result.moves:
            out.write(
                f"migrate {m.request}: {m.source} -> {m.target}  "
                f"(ΔV {m.delta_v:.4g}, {m.tokens:,} tokens, "
                f"remaining {_remaining(m.remaining, params)})\n"
            )
    else:
        out.write(f"decision: no migration ({reason(result, params, _draining(instances))})\n")
    before, after = result.variance_before, result.variance_after
    change = f" ({(after - before) / before:+.1%})" if before > 0 else ""
    out.write(f"weighted variance V: {before:.4g} -> {after:.4g}{change}\n")
