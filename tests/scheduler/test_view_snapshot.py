"""ClusterView.snapshot: the tick's arrays equal from_instances(instances()), the plan too."""

from __future__ import annotations

import dataclasses
import random
import time

import numpy as np
import pytest

from scheduler.view import ClusterView, planner_columns
from star.planner import plan
from star.planner.arrays import from_instances
from star.planner.core import plan_on
from star.planner.types import Mode, PlannerParams
from star.wire import Decision, Event, EventKind, Report, RequestLoad

MODES = ["predicted", "current", "oracle", "bins:4", "no-migration"]


def random_view(rng: random.Random, params: PlannerParams, eager: bool) -> ClusterView:
    columns = planner_columns(params) if eager else ()
    v = ClusterView(staleness_s=3.0, decision_timeout_s=10.0, columns=columns)
    names = [f"i{k}" for k in range(rng.randint(1, 12))]
    for name in names:
        reqs = [
            RequestLoad(
                f"{name}-r{j}",
                rng.randint(1, 4000),
                rng.randint(0, 100),
                None if rng.random() < 0.2 else rng.uniform(0, 3000),
                rng.random() > 0.1,
                None if rng.random() < 0.3 else rng.randint(0, 3000),
            )
            for j in range(rng.randint(0, 9))
        ]
        busy = [r.id for r in reqs if rng.random() < 0.1]
        points = params.horizon + 1 if rng.random() < 0.7 else params.horizon
        trace = [float(rng.randint(0, 9000)) for _ in range(points)] if rng.random() < 0.8 else []
        v.apply_report(
            Report(
                instance=name,
                role="decode" if rng.random() < 0.9 else "prefill",
                seq=1,
                ts=time.time(),
                address="127.0.0.1:1",
                capacity_tokens=rng.choice([20_000, 100_000]),
                used_tokens=sum(r.tokens for r in reqs),
                bytes_per_token=rng.choice([1024, 2048]),
                step_time_s=rng.choice([0.0, 0.02]),
                delta=params.delta if rng.random() < 0.8 else params.delta + 1,
                trace=trace,
                requests=reqs,
                in_flight=busy,
                draining=rng.random() < 0.1,
            ),
            0.0,
        )
    listed = [(s.report.instance, r.id) for s in v.seen.values() for r in s.report.requests]
    for k in range(rng.randint(0, 6)):
        src, rid = rng.choice(listed) if listed and rng.random() < 0.8 else ("gone", "x")
        d = Decision(f"m{k}", rid, src, rng.choice([*names, "gone"]), 1, -1.0, "current", 0.0)
        v.book(d, 0.0)
        if rng.random() < 0.4:
            v.apply_event(Event(EventKind.RESUMED, 1.0, "w", request=rid, migration=d.id))
    return v


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("eager", [True, False])
def test_snapshot_equals_the_instances_arrays_and_plans_the_same(mode: str, eager: bool) -> None:
    params = dataclasses.replace(PlannerParams(), mode=Mode.parse(mode), theta=0.0)
    rng = random.Random(f"{mode}-{eager}")
    rebooked = 0
    for _ in range(150):
        v = random_view(rng, params, eager)
        instances = v.instances(params)
        if not instances:
            continue
        snap = v.snapshot(params)
        rebooked += snap.rebooked
        want = from_instances(instances, params)
        for f in dataclasses.fields(want):
            a, b = getattr(snap.arrays, f.name), getattr(want, f.name)
            if b is None:
                assert a is None, f.name
            else:
                assert a.dtype == b.dtype and np.array_equal(a, b, equal_nan=True), f.name
        assert snap.ids == [i.id for i in instances]
        assert plan_on(snap.arrays, snap.ids, snap.request, params) == plan(instances, params)
        unknown = {r.id for i in instances for r in i.requests if r.true_remaining is None}
        assert snap.unknown_lengths() == unknown
    assert rebooked > 20  # the booked-moves path ran
