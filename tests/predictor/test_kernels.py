"""The tap's compiled round (``star.predictor.kernels``) against the reference code.

:func:`fuse_round` must be :func:`star.predictor.model.fuse_step` row by row
after :meth:`LengthPredictor.decode`/``sigma``, and :func:`mlp` the module's
forward pass; both are checked on generated inputs.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from star.predictor.kernels import fuse_round, mlp
from star.predictor.model import (
    FastPredictor,
    LengthPredictor,
    PredictorConfig,
    fuse_step,
    single_threaded_host_blas,
)

row = st.tuples(
    st.floats(-3.0, 6.0),  # encoded R-hat
    st.floats(-4.0, 4.0),  # log b
    st.integers(0, 4000),  # tokens generated
    st.booleans(),  # known: continues a fusion state
    st.booleans(),  # moved here (first weight 1) when new
    st.integers(1, 5000),  # the cap of a new row
)


@settings(max_examples=200, deadline=None)
@given(
    rows=st.lists(row, min_size=1, max_size=12),
    log_target=st.booleans(),
    uncertainty=st.booleans(),
    decay=st.floats(0.0, 1.0),
    power=st.floats(0.0, 3.0),
    first_weight=st.floats(0.5, 40.0),
)
def test_fuse_round_is_fuse_step_row_by_row(
    rows: list[tuple[float, float, int, bool, bool, int]],
    log_target: bool,
    uncertainty: bool,
    decay: float,
    power: float,
    first_weight: float,
) -> None:
    scale = 50.0
    model = LengthPredictor(PredictorConfig(4, (4,), log_target, scale, uncertainty))
    n = len(rows)
    raw = np.array([[r[0], r[1]] for r in rows], dtype=np.float32)
    # Known rows continue the state of a past round (state j = row i's own).
    state = [(1.0 + i, (1.0 + i) * (300.0 + 10 * i)) for i in range(n)]
    cap0 = np.array([900.0 + i for i in range(n)])
    at = np.array([i if r[3] else -1 for i, r in enumerate(rows)], dtype=np.intp)
    first = np.array([1.0 if r[4] else first_weight for r in rows])
    fresh_cap = np.array([float(r[5]) for r in rows])
    g = np.array([float(r[2]) for r in rows])
    weight, total, cap, served = fuse_round(
        raw,
        log_target,
        uncertainty,
        scale,
        at,
        first,
        fresh_cap,
        g,
        np.array([s[0] for s in state]),
        np.array([s[1] for s in state]),
        cap0,
        decay,
        power,
    )
    raw_t = torch.from_numpy(raw.astype(np.float64))
    r_hat = model.decode(raw_t[:, 0]).double()
    sigma = (
        model.sigma(raw_t[:, 0], raw_t[:, 1]) if uncertainty else torch.ones(n, dtype=torch.float64)
    )
    for i, (_, _, gen, known, moved, new_cap) in enumerate(rows):
        (w_want, t_want), unclipped = fuse_step(
            state[i] if known else None,
            float(r_hat[i]),
            float(sigma[i]),
            gen,
            decay,
            power,
            1.0 if moved else first_weight,
        )
        c = cap0[i] if known else new_cap
        assert cap[i] == c
        assert weight[i] == pytest.approx(w_want, rel=1e-9, abs=1e-300)
        assert total[i] == pytest.approx(t_want, rel=1e-9, abs=1e-300)
        want = max(min(unclipped + gen, c) - gen, 0.0)
        assert served[i] == pytest.approx(want, rel=1e-6, abs=1e-6)


def test_an_overflowing_output_serves_the_cap_and_does_not_raise() -> None:
    raw = np.array([[np.inf, np.inf], [np.nan, 0.0], [1e30, -1e30]], dtype=np.float32)
    _, _, _, served = fuse_round(
        raw,
        True,
        True,
        100.0,
        np.full(3, -1, dtype=np.intp),
        np.ones(3),
        np.full(3, 200.0),
        np.array([10.0, 20.0, 30.0]),
        np.zeros(0),
        np.zeros(0),
        np.zeros(0),
        0.5,
        2.0,
    )
    assert np.all(np.isfinite(served)) and np.all(served <= 200.0 - np.array([10, 20, 30]))


@pytest.mark.parametrize("hidden", [(16,), (32, 16, 8)])
def test_mlp_is_the_modules_forward(hidden: tuple[int, ...]) -> None:
    torch.manual_seed(0)
    model = LengthPredictor(PredictorConfig(12, hidden, uncertainty=True)).eval()
    model.set_normalisation(torch.randn(12), torch.rand(12) + 0.5)
    fast = FastPredictor(model)
    assert fast.host
    x = torch.randn(9, 12)
    got = mlp(x.numpy(), fast.np_weights, fast.np_biases)
    with torch.no_grad():
        want = model.forward_all(x).numpy()
    assert got.dtype == np.float32 and got.shape == (9, 2)
    assert np.allclose(got, want, rtol=1e-4, atol=1e-4)
    # Through raw_host as the tap calls it: a numpy view, or a tensor.
    assert np.allclose(fast.raw_host(x.numpy()), want, rtol=1e-4, atol=1e-4)
    assert np.allclose(fast.raw_host(x.to(torch.bfloat16)), want, rtol=0.05, atol=0.05)


def test_host_blas_is_single_threaded_for_numpy_and_scipy() -> None:
    import scipy.linalg.cython_blas  # noqa: F401 - loaded, so that its threads are restored
    from threadpoolctl import ThreadpoolController, threadpool_info

    before = ThreadpoolController().select(user_api="blas")
    threads = [lib.num_threads for lib in before.lib_controllers]
    try:
        assert single_threaded_host_blas()
        blas = [
            lib
            for lib in threadpool_info()
            if lib["user_api"] == "blas"
            and ("numpy" in lib["filepath"] or "scipy" in lib["filepath"])
        ]
        assert any("scipy" in lib["filepath"] for lib in blas)  # the one the compiled MLP calls
        assert all(lib["num_threads"] == 1 for lib in blas)
    finally:  # the rest of this test process keeps its threads
        for lib, n in zip(before.lib_controllers, threads, strict=True):
            lib.set_num_threads(n)
