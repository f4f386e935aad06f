"""``from_instances``: the planner's arrays are the requests' fields, row for row."""

from __future__ import annotations

import math

import numpy as np
import pytest

from star.planner import Instance, Mode, PlannerParams, Request
from star.planner.arrays import from_instances

CLUSTER = [
    Instance(
        "a",
        (
            Request("a1", 100, 50.0, 60, migratable=True),
            Request("a2", 200, None, None, migratable=False),
            Request("a3", 300, 7, 8),  # ints where floats are expected
            Request("a4", 400, math.nan, 9),
        ),
        10_000,
        busy=frozenset({"a3"}),
    ),
    Instance("b", (), 10_000),
    Instance("c", (Request("c1", 5, 1.5, None),), 10_000),
]


def expected(field: str, r: Request) -> float:
    value = getattr(r, field)
    return math.nan if value is None else float(value)


@pytest.mark.parametrize("mode", ["predicted", "bins:4", "oracle", "current"])
def test_columns_are_the_request_fields(mode: str) -> None:
    params = PlannerParams(mode=Mode.parse(mode))
    arrays = from_instances(CLUSTER, params)
    reqs = [r for inst in CLUSTER for r in inst.requests]
    assert arrays.offsets.tolist() == [0, 4, 4, 5]
    assert arrays.tokens.tolist() == [r.tokens for r in reqs]
    want_pred = [expected("predicted_remaining", r) for r in reqs]
    want_true = [expected("true_remaining", r) for r in reqs]
    nan = [math.nan] * len(reqs)
    kind = Mode.parse(mode).kind.value
    np.testing.assert_array_equal(
        arrays.predicted, want_pred if kind in ("predicted", "bins") else nan
    )
    np.testing.assert_array_equal(arrays.true_remaining, want_true if kind == "oracle" else nan)
    assert arrays.predicted.dtype == arrays.true_remaining.dtype == np.float64
    # Not migratable, or already being moved (busy): not eligible.
    assert arrays.eligible.tolist() == [True, False, False, True, True]


def test_all_migratable() -> None:
    arrays = from_instances([CLUSTER[2], CLUSTER[1]], PlannerParams())
    assert arrays.eligible.dtype == np.bool_ and arrays.eligible.tolist() == [True]
