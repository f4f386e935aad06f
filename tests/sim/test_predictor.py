"""The simulated length predictor is calibrated to the paper's Fig. 7."""

from __future__ import annotations

import numpy as np
import pytest

from star.sim.predictor import (
    CORRELATION_TOKENS,
    NoiseState,
    PriorMedian,
    noisy_estimate,
    prediction_points,
)
from star.sim.workload import MAX_OUTPUT_TOKENS, synthetic


@pytest.fixture(scope="module")
def outputs() -> np.ndarray:
    return synthetic("sharegpt", 200_000, np.random.default_rng(0)).output_tokens


def _mae(outputs: np.ndarray, generated: int, seed: int = 1) -> float:
    prior = PriorMedian(outputs)
    long = outputs[(outputs >= 30_000) & (outputs <= MAX_OUTPUT_TOKENS)].astype(np.float64)
    z = np.random.default_rng(seed).standard_normal(long.size)
    g = np.full(long.size, generated)
    est = noisy_estimate(long - generated, g, z, prior)
    return float(np.abs(est - (long - generated)).mean())


def test_mae_matches_fig7_at_prompt_only_and_after_8000_tokens(outputs: np.ndarray) -> None:
    # Paper §4.3: "with only input prompt, the MAE of our method is 18256 tokens,
    # while after generating 8000 tokens, the MAE drops to 2929 tokens" (30-32K outputs).
    assert _mae(outputs, 0) == pytest.approx(18_256, rel=0.10)
    assert _mae(outputs, 8_000) == pytest.approx(2_929, rel=0.10)


def test_error_shrinks_with_progress(outputs: np.ndarray) -> None:
    maes = [_mae(outputs, g) for g in (2_000, 8_000, 16_000, 24_000)]
    assert maes == sorted(maes, reverse=True)
    assert maes[-1] < 0.25 * maes[0]


def test_estimates_stay_in_range(outputs: np.ndarray) -> None:
    prior = PriorMedian(outputs)
    rng = np.random.default_rng(2)
    g = rng.integers(0, 30_000, 5000)
    true = rng.integers(1, 2000, 5000)
    est = noisy_estimate(true, g, 5 * rng.standard_normal(5000), prior)
    assert bool(np.all(est >= 1.0)) and bool(np.all(est <= np.maximum(1, MAX_OUTPUT_TOKENS - g)))


def test_prior_is_the_conditional_median(outputs: np.ndarray) -> None:
    prior = PriorMedian(outputs)
    assert prior(np.array([0]))[0] == pytest.approx(np.median(outputs), rel=0.01)
    g = 8192
    assert prior(np.array([g]))[0] == pytest.approx(np.median(outputs[outputs > g]) - g, rel=0.01)


def test_noise_is_a_stationary_correlated_process() -> None:
    state = NoiseState(20_000, np.random.default_rng(3))
    idx = np.arange(20_000)
    z0 = state.advance(idx, np.zeros(20_000, dtype=np.int64)).copy()
    step = int(CORRELATION_TOKENS)
    z1 = state.advance(idx, np.full(20_000, step, dtype=np.int64)).copy()
    assert float(z1.std()) == pytest.approx(1.0, abs=0.03)
    assert float(np.corrcoef(z0, z1)[0, 1]) == pytest.approx(np.exp(-1.0), abs=0.03)
    # Asking again at the same point draws nothing new.
    assert np.array_equal(state.advance(idx, np.full(20_000, step, dtype=np.int64)), z1)


def test_prediction_points_every_k() -> None:
    g = np.array([0, 1, 19, 20, 39, 40, 101])
    assert prediction_points(g, 20).tolist() == [0, 0, 0, 20, 20, 40, 100]
    assert prediction_points(g, 1).tolist() == g.tolist()
