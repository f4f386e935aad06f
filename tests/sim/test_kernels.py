"""The simulator's fast paths answer exactly what the plain paths answer.

The simulator hands the planner arrays (``plan_arrays``) where the live
scheduler hands it objects (``plan``); both must decide the same moves on the
same cluster state. Its compiled per-tick kernels must match the numpy forms
they replace.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from star.planner import plan
from star.planner.arrays import plan_arrays
from star.planner.types import ModeKind
from star.sim import SimConfig
from star.sim.decode import steps_done
from star.sim.engine import Simulator
from star.sim.kernels import read_instances, warm
from star.sim.predictor import LAMBDA_TOKENS, S0, S_MIN, W0, PriorMedian, noisy_estimate
from star.sim.snapshot import Snapshot


@pytest.mark.parametrize("mode", ["current", "predicted", "oracle", "bins:6"])
def test_array_and_object_entry_points_decide_the_same(mode: str) -> None:
    # Seed 6: an end state where every mode has moves to offer.
    sim = Simulator(SimConfig(decode_instances=16, duration_s=300.0, mode=mode, seed=6))
    sim.run()
    # theta = 0 and several moves per tick: plenty of candidates to disagree on.
    params = dataclasses.replace(sim.params, theta=0.0, max_migrations=4)
    snap = Snapshot(sim, sim.cfg.duration_s + 0.5)
    given_traces = sim.mode.kind is ModeKind.PREDICTED
    objects = plan(snap.instances(with_traces=given_traces), params)
    arrays, rows = snap.arrays(with_traces=given_traces)
    fast = plan_arrays(arrays, params)

    assert objects.moves, "the state should offer moves"
    assert [(m.request, m.source, m.target) for m in objects.moves] == [
        (str(int(rows[q])), sim.fleet.ids[s], sim.fleet.ids[t])
        for q, s, t in zip(
            fast.rows.tolist(), fast.sources.tolist(), fast.targets.tolist(), strict=True
        )
    ]
    assert [m.delta_v for m in objects.moves] == fast.delta_v.tolist()
    assert list(objects.workloads.values()) == fast.workloads.tolist()
    assert objects.variance_after == fast.variance_after


@settings(max_examples=200, deadline=None)
@given(
    elapsed=st.floats(-1.0, 50.0),
    load=st.integers(0, 400_000),
    batch=st.integers(0, 64),
    b=st.sampled_from([0.0, 1e-8, 1e-7]),
    extra=st.floats(0.0, 2.0),
    cap=st.integers(0, 100_000),
)
def test_read_instances_matches_steps_done(
    elapsed: float, load: int, batch: int, b: float, extra: float, cap: int
) -> None:
    a = 0.008
    steps = 17
    tbsum = load - batch * steps
    at, loads = read_instances(
        10.0,
        np.array([10.0 - elapsed]),
        np.array([steps], dtype=np.int64),
        np.array([batch], dtype=np.int64),
        np.array([tbsum], dtype=np.int64),
        np.array([extra]),
        np.array([cap], dtype=np.int64),
        a,
        b,
    )
    want = steps_done(
        np.array([10.0 - (10.0 - elapsed)]),
        np.array([float(load)]),
        np.array([float(batch)]),
        a,
        b,
        np.array([extra]),
        np.array([float(cap)]),
    )
    done = int(want[0]) if batch else 0
    assert int(at[0]) == steps + done
    assert float(loads[0]) == load + batch * done


def test_noisy_estimate_kernel_matches_the_formula() -> None:
    rng = np.random.default_rng(5)
    prior = PriorMedian(rng.integers(1, 32_768, 5_000))
    r = rng.integers(1, 30_000, 500).astype(np.float64)
    g = rng.integers(0, 30_000, 500).astype(np.float64)
    z = rng.standard_normal(500)
    decay = np.exp(-g / LAMBDA_TOKENS)
    w = W0 * decay
    s = np.maximum(S_MIN, S0 * decay)
    log_hat = (1 - w) * np.log(r) + w * np.log(prior(g)) + s * z
    want = np.clip(np.exp(log_hat), 1.0, np.maximum(1.0, 32_768 - g))
    np.testing.assert_allclose(noisy_estimate(r, g, z, prior), want, rtol=1e-12)


def test_warm_is_cheap_once_compiled() -> None:
    warm()
    assert warm() < 1.0


def test_fused_prediction_matches_noise_state_and_estimate() -> None:
    from star.sim.kernels import predict, prediction_points
    from star.sim.predictor import CORRELATION_TOKENS, PRIOR_STEP, NoiseState

    rng = np.random.default_rng(9)
    prior = PriorMedian(rng.integers(1, 32_768, 5_000))
    output = rng.integers(2, 32_768, 300).astype(np.int64)
    idx = rng.permutation(300)[:200].astype(np.int64)
    plain = NoiseState(300, np.random.default_rng(1))
    fused = NoiseState(300, np.random.default_rng(1))
    generated = np.zeros(200, dtype=np.int64)
    for _ in range(5):
        generated = np.minimum(generated + rng.integers(0, 90, 200), output[idx] - 1)
        at = (generated // 20) * 20
        z = plain.advance(idx, at)
        want = np.maximum(noisy_estimate(output[idx] - at, at, z, prior) - (generated - at), 1.0)
        points, moved = prediction_points(idx, generated, 20, fused.at)
        got = predict(
            idx, generated, points, fused.draw(moved), fused.z, fused.at, output,
            CORRELATION_TOKENS, prior.table, float(PRIOR_STEP), W0, LAMBDA_TOKENS, S0, S_MIN,
            32_768.0,
        )  # fmt: skip
        np.testing.assert_allclose(got, want, rtol=1e-12)
        np.testing.assert_array_equal(fused.at, plain.at)


def test_tabled_prediction_is_bit_identical() -> None:
    from star.sim.kernels import predict, predict_tabled, prediction_points, prediction_tables
    from star.sim.predictor import CORRELATION_TOKENS, PRIOR_STEP, NoiseState

    rng = np.random.default_rng(11)
    prior = PriorMedian(rng.integers(1, 32_768, 5_000))
    output = rng.integers(2, 32_768, 400).astype(np.int64)
    idx = rng.permutation(400)[:300].astype(np.int64)
    consts = (CORRELATION_TOKENS, prior.table, float(PRIOR_STEP), W0, LAMBDA_TOKENS, S0, S_MIN)
    for every in (1, 7, 20):
        tables = prediction_tables(every, 32_768, *consts)
        plain = NoiseState(400, np.random.default_rng(2))
        tabled = NoiseState(400, np.random.default_rng(2))
        generated = np.zeros(300, dtype=np.int64)
        for _ in range(6):
            generated = np.minimum(generated + rng.integers(0, 200, 300), output[idx] - 1)
            points, moved = prediction_points(idx, generated, every, plain.at)
            want = predict(
                idx, generated, points, plain.draw(moved), plain.z, plain.at, output, *consts,
                32_768.0,
            )  # fmt: skip
            points, moved = prediction_points(idx, generated, every, tabled.at)
            got = predict_tabled(
                idx, generated, points, tabled.draw(moved), tabled.z, tabled.at, output, every,
                *tables, *consts, 32_768.0,
            )  # fmt: skip
            np.testing.assert_array_equal(got, want)
            np.testing.assert_array_equal(tabled.z, plain.z)
