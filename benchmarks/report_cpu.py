"""The scheduler's CPU per report, in this process: decode, ``ClusterView.apply_report``,
``AccuracyTracker.observe`` (what ``scheduler.service`` does with each report).

Reports come from :mod:`benchmarks.emulated_workers` (the bodies ``star bench
scheduler`` publishes), round after round of every instance, so the tracker
fills to its bound and evicts as it does live. Bodies are built outside the
timed part; each stage is timed with ``time.process_time`` (the machine's load
does not enter). The last line of output is a digest of the resulting state
(the tracker's histories and summary, the planner's view), so two trees can be
compared for identical results::

    python -m benchmarks.report_cpu --instances 1024 --rounds 30 --warmup 10
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import time

from benchmarks.emulated_workers import advance, make_fleet, report_body
from scheduler.view import ClusterView
from star.bus.signing import Signer
from star.planner.types import PlannerParams
from star.predictor.live import AccuracyTracker
from star.process import set_gc_gen0_threshold
from star.settings import load_settings
from star.wire import Report, decode


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--instances", type=int, default=1024)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--step-ms", type=float, default=25.0)
    parser.add_argument("--rounds", type=int, default=30, help="timed rounds (one report each)")
    parser.add_argument("--warmup", type=int, default=10, help="untimed rounds first")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--profile", help="write a cProfile of the timed rounds here")
    parser.add_argument(
        "--secret",
        default="",
        help="check each report's signature before decoding it, as a scheduler with this "
        "cluster.secret does (star.bus.signing; bodies are signed outside the timed part)",
    )
    args = parser.parse_args()

    settings = load_settings()
    set_gc_gen0_threshold(settings.scheduler.gc_gen0_threshold)  # as the scheduler does
    fleet = make_fleet(args.instances, args.requests, args.step_ms, settings, args.seed)
    params = PlannerParams.from_settings(settings)
    view = ClusterView.for_scheduler(settings.scheduler, params)  # as scheduler.service
    tracker = AccuracyTracker()
    cpu = {"decode": 0.0, "apply": 0.0, "observe": 0.0}
    signer = Signer(args.secret) if args.secret else None
    key = f"{settings.bus.prefix}:reports"
    if signer is not None:
        cpu["verify"] = 0.0
    timed = 0
    batch = settings.bus.read_count
    ts = 1.0e9
    profiler = None
    for rnd in range(args.warmup + args.rounds):
        bodies = []
        for inst in fleet.instances:
            advance(fleet, inst)
            ts += inst.period_s / args.instances
            bodies.append(report_body(fleet, inst, ts)[0])
        sigs = [signer.sign(key, b).encode() for b in bodies] if signer is not None else []
        measuring = rnd >= args.warmup
        if measuring and args.profile and profiler is None:
            import cProfile

            profiler = cProfile.Profile()
            profiler.enable()
        # As scheduler.service: a batch of bus.read_count entries decoded, then
        # each report applied and observed in turn.
        for lo in range(0, len(bodies), batch):
            tv = time.process_time()
            if signer is not None:  # as Publisher.decode_or_bury, before decoding
                for body, sig in zip(bodies[lo : lo + batch], sigs[lo : lo + batch], strict=True):
                    if signer.check(key, body, sig) is not None:
                        raise AssertionError("a report signed here does not verify")
            t0 = time.process_time()
            reports = [decode(body, Report) for body in bodies[lo : lo + batch]]
            t1 = time.process_time()
            apply = observe = 0.0
            for i, report in enumerate(reports):
                assert isinstance(report, Report)
                ta = time.process_time()
                view.apply_report(report, rnd + (lo + i) / len(bodies))
                tb = time.process_time()
                tracker.observe(report)
                tc = time.process_time()
                apply += tb - ta
                observe += tc - tb
            del reports
            if measuring:
                if signer is not None:
                    cpu["verify"] += t0 - tv
                cpu["decode"] += t1 - t0
                cpu["apply"] += apply
                cpu["observe"] += observe
        if measuring:
            timed += len(bodies)
    if profiler is not None:
        profiler.disable()
        profiler.dump_stats(args.profile)
    per = {k: round(v / timed * 1e6, 1) for k, v in cpu.items()}
    per["total"] = round(sum(cpu.values()) / timed * 1e6, 1)
    rate = sum(1 / inst.period_s for inst in fleet.instances)
    print(
        json.dumps(
            {
                "reports": timed,
                "us_per_report": per,
                "reports_per_s": round(rate),
                "cpu_s_per_s": round(rate * per["total"] / 1e6, 3),
                "tracked": len(tracker),
                "forgotten": tracker.forgotten,
                "gc_counts": gc.get_count(),
            }
        )
    )
    print("digest", _digest(tracker, view, PlannerParams.from_settings(settings)))


def _digest(tracker: AccuracyTracker, view: ClusterView, params: PlannerParams) -> str:
    h = hashlib.sha256()
    h.update(repr(tracker.summary()).encode())
    h.update(repr((tracker.forgotten, tracker.dropped_points, len(tracker))).encode())
    for rid, hist in tracker._live.items():  # in order: eviction depends on it
        state = (rid, hist.points, hist.prompt, hist.seen, hist.next_n, hist.stride)
        h.update(repr(state).encode())
    h.update(repr(view.instances(params)).encode())
    return h.hexdigest()[:16]


if __name__ == "__main__":
    main()
