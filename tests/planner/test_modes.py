"""Modes, R-hat per mode (incl. the paper's Table 4 bins), weights, the grid and parameters."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from star.planner import (
    BIN_EDGES,
    Instance,
    Mode,
    ModeKind,
    PlannerParams,
    Request,
    plan,
    remaining_for,
    weights,
)
from star.planner.trace import bin_edges, cutoffs, grid, instance_traces, remaining_array
from star.planner.types import validate_params
from tests.planner.helpers import MODES, cluster_st, params_st
from tests.planner.reference import reference_plan, reference_traces

K = 1024


@pytest.mark.parametrize(
    ("text", "mode"),
    [
        ("no-migration", Mode(ModeKind.NO_MIGRATION)),
        ("current", Mode(ModeKind.CURRENT)),
        ("predicted", Mode(ModeKind.PREDICTED)),
        (" oracle ", Mode(ModeKind.ORACLE)),
        ("bins:2", Mode(ModeKind.BINS, 2)),
        ("bins:4", Mode(ModeKind.BINS, 4)),
        ("bins:6", Mode(ModeKind.BINS, 6)),
    ],
)
def test_mode_parse_round_trips(text: str, mode: Mode) -> None:
    assert Mode.parse(text) == mode
    assert Mode.parse(str(mode)) == mode


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("vllm", "unknown mode 'vllm'"),
        ("", "unknown mode ''"),
        ("bins", "bins takes 2, 4 or 6"),
        ("bins:3", "bins takes 2, 4 or 6"),
        ("bins:x", "bins takes 2, 4 or 6"),
        ("predicted:2", "only bins takes an argument"),
    ],
)
def test_mode_parse_errors_quote_the_input(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Mode.parse(text)


R = Request("r", 100, predicted_remaining=5000.0, true_remaining=1234)


@pytest.mark.parametrize(
    ("mode", "r", "expect"),
    [
        ("current", R, math.inf),
        ("no-migration", R, math.inf),
        ("predicted", R, 5000.0),
        ("predicted", dataclasses.replace(R, predicted_remaining=None), math.inf),
        ("predicted", dataclasses.replace(R, predicted_remaining=-3.0), 1.0),  # clamped
        ("predicted", dataclasses.replace(R, predicted_remaining=0.25), 1.0),
        ("oracle", R, 1234.0),
        ("oracle", dataclasses.replace(R, true_remaining=0), 1.0),
        ("bins:2", dataclasses.replace(R, predicted_remaining=None), math.inf),
    ],
)
def test_remaining_for(mode: str, r: Request, expect: float) -> None:
    assert remaining_for(r, Mode.parse(mode)) == expect


@pytest.mark.parametrize(
    ("bins", "predicted", "midpoint"),
    [
        # 2 bins: [0, 8K), [8K, 32K]
        (2, 0.0, 4 * K),
        (2, 8 * K - 0.5, 4 * K),
        (2, 8 * K, 20 * K),
        (2, 32 * K, 20 * K),
        (2, 100 * K, 20 * K),  # past the top edge: top bin
        (2, -7.0, 4 * K),
        # 4 bins: [0, 4K), [4K, 8K), [8K, 16K), [16K, 32K]
        (4, 100.0, 2 * K),
        (4, 4 * K, 6 * K),
        (4, 9000.0, 12 * K),
        (4, 16 * K, 24 * K),
        # 6 bins: [0, 2K), [2K, 4K), [4K, 6K), [6K, 8K), [8K, 16K), [16K, 32K]
        (6, 2047.0, 1 * K),
        (6, 2 * K, 3 * K),
        (6, 5000.0, 5 * K),
        (6, 7 * K, 7 * K),
        (6, 8 * K, 12 * K),
        (6, 31 * K, 24 * K),
    ],
)
def test_bins_quantise_to_the_midpoint_of_the_paper_table4_bin(
    bins: int, predicted: float, midpoint: float
) -> None:
    request = dataclasses.replace(R, predicted_remaining=predicted)
    assert remaining_for(request, Mode.parse(f"bins:{bins}")) == midpoint


def test_bin_edges_are_the_papers() -> None:
    assert BIN_EDGES[2] == (0, 8 * K, 32 * K)
    assert BIN_EDGES[4] == (0, 4 * K, 8 * K, 16 * K, 32 * K)
    assert BIN_EDGES[6] == (0, 2 * K, 4 * K, 6 * K, 8 * K, 16 * K, 32 * K)


def test_oracle_reads_an_unknown_length_as_unknown() -> None:
    # A live worker knows a request's length only when it is fixed (ignore_eos
    # with max_tokens): the others are read as a missing prediction is.
    unknown = dataclasses.replace(R, id="r9", true_remaining=None)
    assert remaining_for(unknown, Mode.parse("oracle")) == math.inf
    assert remaining_array([R, unknown], Mode.parse("oracle")).tolist() == [1234.0, math.inf]


def _oracle_cluster() -> list[Instance]:
    # s is overloaded with three requests, t is empty. "short" holds the most
    # tokens but ends at once: without lengths (current) it is the best move;
    # knowing them (oracle), it is too short to move and another goes.
    return [
        Instance(
            "s",
            (
                Request("short", 1800, true_remaining=1),
                Request("long", 1000, true_remaining=4000),
                Request("unknown", 600, true_remaining=None),
            ),
            capacity_tokens=100_000,
            bytes_per_token=1024,
            step_time_s=0.02,
        ),
        Instance("t", (), capacity_tokens=100_000, bytes_per_token=1024, step_time_s=0.02),
    ]


@pytest.mark.parametrize(
    ("mode", "moved", "remaining"),
    [("current", "short", math.inf), ("oracle", "long", 4000.0)],
)
def test_oracle_plans_on_true_lengths_among_unknown_ones(
    mode: str, moved: str, remaining: float
) -> None:
    params = PlannerParams(mode=Mode.parse(mode), horizon=8, delta=32)
    result = plan(_oracle_cluster(), params)
    assert [(m.request, m.source, m.target) for m in result.moves] == [(moved, "s", "t")]
    assert result.moves[0].remaining == remaining
    # The naive reference agrees (unknown read as inf there too).
    ref = reference_plan(_oracle_cluster(), params)
    assert [m.request for m in ref.moves] == [moved]


@pytest.mark.parametrize(
    ("bins", "scale", "edges"),
    [
        (2, 32 * K, (0, 8 * K, 32 * K)),  # the paper's
        (2, 4096, (0, 1024, 4096)),
        (4, 4096, (0, 512, 1024, 2048, 4096)),
        (6, 4096, (0, 256, 512, 768, 1024, 2048, 4096)),
        (4, 2048, (0, 256, 512, 1024, 2048)),
    ],
)
def test_bin_edges_scale_with_the_served_length(
    bins: int, scale: int, edges: tuple[int, ...]
) -> None:
    assert bin_edges(bins, scale) == tuple(float(e) for e in edges)


@pytest.mark.parametrize(
    ("predicted", "scale", "midpoint"),
    [
        # bins:4 at the paper's scale: every answer of a 4K-context model is in [0, 4K).
        (600.0, None, 2 * K),
        (1500.0, None, 2 * K),
        # At the tiny model's 4,096 tokens: [0, 512), [512, 1K), [1K, 2K), [2K, 4K].
        (600.0, 4096, 768.0),
        (1500.0, 4096, 1536.0),
        (100.0, 4096, 256.0),
        (9000.0, 4096, 3072.0),  # past the top edge: top bin
    ],
)
def test_bins_mode_quantises_on_the_params_scale(
    predicted: float, scale: int | None, midpoint: float
) -> None:
    params = PlannerParams(mode=Mode.parse("bins:4"), horizon=4)
    if scale is not None:
        params = dataclasses.replace(params, bins_scale_tokens=scale)
    request = dataclasses.replace(R, predicted_remaining=predicted)
    assert remaining_for(request, params.mode, params.bins_scale_tokens) == midpoint
    assert remaining_array([request], params.mode, params.bins_scale_tokens).tolist() == [midpoint]
    # The planner (on arrays) moves one of two such requests, seeing that R-hat.
    pair = (Request("a", 1000, predicted), Request("b", 1000, predicted))
    result = plan(
        [Instance("s", pair, 100_000), Instance("t", (), 100_000)],
        dataclasses.replace(params, min_gain=0.0),
    )
    assert [m.remaining for m in result.moves] == [midpoint]


def test_bins_scale_defaults_to_the_papers_and_must_be_positive() -> None:
    assert PlannerParams().bins_scale_tokens == 32 * K  # the simulator's: the paper's lengths
    with pytest.raises(ValueError, match="bins_scale_tokens=0"):
        validate_params(PlannerParams(bins_scale_tokens=0))


@settings(max_examples=60, deadline=None)
@given(
    st.sampled_from((*MODES, "no-migration")),
    st.lists(
        st.tuples(
            st.none() | st.floats(-100, 100_000, allow_nan=False),
            st.integers(0, 100_000),
        ),
        max_size=20,
    ),
)
def test_vectorised_remaining_matches_remaining_for(
    mode: str, values: list[tuple[float | None, int]]
) -> None:
    reqs = [Request(f"r{i}", 10, p, t) for i, (p, t) in enumerate(values)]
    m = Mode.parse(mode)
    assert remaining_array(reqs, m).tolist() == [remaining_for(r, m) for r in reqs]


@settings(max_examples=60, deadline=None)
@given(
    st.integers(0, 80),
    st.integers(1, 500),
    st.lists(st.floats(1, 1e6, allow_nan=False) | st.just(math.inf), max_size=50),
)
def test_cutoffs_count_grid_points_strictly_before_the_end(
    horizon: int, delta: int, remaining: list[float]
) -> None:
    tau = np.arange(horizon + 1, dtype=np.float64) * delta
    # include exact grid points and their neighbours, where rounding bites
    edge = [float(x) for x in tau[1:]] + [math.nextafter(float(x), math.inf) for x in tau[1:]]
    arr = np.array(remaining + edge, dtype=np.float64)
    assert cutoffs(arr, tau).tolist() == np.searchsorted(tau, arr, side="left").tolist()


@settings(max_examples=60, deadline=None)
@given(params_st().flatmap(lambda p: st.tuples(st.just(p), cluster_st(p))))
def test_vectorised_traces_match_request_by_request(
    case: tuple[PlannerParams, list[Instance]],
) -> None:
    params, cluster = case
    np.testing.assert_allclose(
        instance_traces(cluster, params), reference_traces(cluster, params), rtol=1e-12
    )


def test_trace_definition_by_hand() -> None:
    # c_r(tau) = N + tau while tau < R-hat, else 0; tau_j = j * delta.
    params = PlannerParams(horizon=3, delta=10)
    reqs = (Request("a", 100, 15.0), Request("b", 50, None), Request("c", 7, 0.0))
    got = instance_traces([Instance("i", reqs, 10**6)], params)[0].tolist()
    # a: 100, 110, 0, 0; b: 50, 60, 70, 80; c (clamped to 1 token): 7, 0, 0, 0
    assert got == [157.0, 170.0, 70.0, 80.0]
    assert grid(params).tolist() == [0.0, 10.0, 20.0, 30.0]


@pytest.mark.parametrize(("horizon", "decay"), [(0, 0.95), (1, 0.5), (64, 0.95), (10, 1.0)])
def test_weights_are_geometric_and_normalised(horizon: int, decay: float) -> None:
    beta = weights(PlannerParams(horizon=horizon, beta_decay=decay))
    assert beta.shape == (horizon + 1,)
    assert math.isclose(beta.sum(), 1.0, rel_tol=1e-12)
    np.testing.assert_allclose(beta[1:] / beta[:-1], decay)
    assert beta[0] == beta.max()


@pytest.mark.parametrize("mode", ["current", "no-migration"])
def test_current_modes_look_at_the_present_only(mode: str) -> None:
    params = PlannerParams(mode=Mode.parse(mode), horizon=64)
    assert weights(params).tolist() == [1.0]
    assert grid(params).tolist() == [0.0]


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("horizon", -1, "horizon=-1"),
        ("delta", 0, "delta=0"),
        ("beta_decay", 0.0, "beta_decay=0.0"),
        ("theta", -0.1, "theta=-0.1"),
        ("min_gain", math.nan, "min_gain=nan"),
        ("max_migrations", -2, "max_migrations=-2"),
        ("bandwidth_bytes_per_s", 0.0, "bandwidth_bytes_per_s=0.0"),
        ("handoff_latency_s", -1.0, "handoff_latency_s=-1.0"),
        ("default_step_time_s", math.inf, "default_step_time_s=inf"),
    ],
)
def test_bad_parameters_are_rejected_quoting_the_value(
    field: str, value: Any, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        validate_params(dataclasses.replace(PlannerParams(), **{field: value}))
