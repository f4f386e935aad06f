"""Report numbers from engine stats: table tests of the trace, step time and report."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from star.sampling import continuation
from star.wire import Report, RequestLoad, decode_as, encode
from workers.state import (
    EngineStats,
    RunningRequest,
    build_report,
    effective_remaining,
    grid,
    is_migratable,
    length_budget,
    load_trace,
    mean_step_time,
)


def snapshot(**kw: object) -> EngineStats:
    values: dict[str, object] = {
        "ts": 0.0,
        "block_size": 16,
        "num_blocks": 100,
        "bytes_per_token": 512,
        "kv_usage": 0.0,
        "running": (),
        "waiting": 0,
        "steps": 0,
        "decode_steps": 0,
        "decode_time_s": 0.0,
        "preemptions": 0,
    }
    values.update(kw)
    return EngineStats(**values)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("delta", "horizon", "expected"),
    [(1, 0, [0.0]), (4, 3, [0.0, 4.0, 8.0, 12.0]), (32, 2, [0.0, 32.0, 64.0])],
)
def test_grid(delta: int, horizon: int, expected: list[float]) -> None:
    assert grid(delta, horizon) == expected


@pytest.mark.parametrize(("delta", "horizon"), [(0, 3), (-1, 3), (4, -1)])
def test_grid_rejects_bad_parameters(delta: int, horizon: int) -> None:
    with pytest.raises(ValueError, match="delta"):
        grid(delta, horizon)


@pytest.mark.parametrize(
    ("predicted", "expected"),
    [(None, math.inf), (math.nan, math.inf), (0.0, 1.0), (-5.0, 1.0), (0.4, 1.0), (7.5, 7.5)],
)
def test_effective_remaining(predicted: float | None, expected: float) -> None:
    assert effective_remaining(predicted) == expected


# (N, R-hat) pairs, delta, H -> L(tau_0..tau_H); tau = 0, 10, 20, 30 unless said.
TRACES = [
    pytest.param([], 10, 3, [0.0, 0.0, 0.0, 0.0], id="idle"),
    pytest.param([(100, None)], 10, 3, [100.0, 110.0, 120.0, 130.0], id="unknown-keeps-going"),
    pytest.param([(100, 25.0)], 10, 3, [100.0, 110.0, 120.0, 0.0], id="ends-between-points"),
    pytest.param([(100, 20.0)], 10, 3, [100.0, 110.0, 0.0, 0.0], id="ends-on-a-point"),
    pytest.param([(100, 0.0)], 10, 3, [100.0, 0.0, 0.0, 0.0], id="zero-still-counts-now"),
    pytest.param([(100, 1e9)], 10, 3, [100.0, 110.0, 120.0, 130.0], id="beyond-horizon"),
    pytest.param(
        [(100, 15.0), (50, None), (10, 35.0)],
        10,
        3,
        [160.0, 190.0, 100.0, 120.0],
        id="mixed",
    ),
    pytest.param([(7, 3.0), (9, None)], 1, 4, [16.0, 18.0, 20.0, 12.0, 13.0], id="delta-1"),
    pytest.param([(5, None), (6, 2.0)], 32, 0, [11.0], id="h0-is-current-load"),
]


@pytest.mark.parametrize(("requests", "delta", "horizon", "expected"), TRACES)
def test_load_trace(
    requests: list[tuple[int, float | None]], delta: int, horizon: int, expected: list[float]
) -> None:
    assert load_trace(requests, delta, horizon) == expected


@given(
    st.lists(
        st.tuples(
            st.integers(0, 100_000),
            st.one_of(st.none(), st.floats(-10, 5_000, allow_nan=False)),
        ),
        max_size=30,
    ),
    st.integers(1, 64),
    st.integers(0, 40),
)
@settings(max_examples=200, deadline=None)
def test_load_trace_agrees_with_the_planner(
    requests: list[tuple[int, float | None]], delta: int, horizon: int
) -> None:
    """The worker's trace is the one the planner would compute (predicted mode)."""
    np = pytest.importorskip("numpy")
    trace_mod = pytest.importorskip("star.planner.trace")
    types = pytest.importorskip("star.planner.types")
    instance = types.Instance(
        id="d0",
        requests=tuple(
            types.Request(id=f"r{i}", tokens=n, predicted_remaining=r)
            for i, (n, r) in enumerate(requests)
        ),
        capacity_tokens=1,
    )
    params = types.PlannerParams(
        mode=types.Mode(types.ModeKind.PREDICTED), horizon=horizon, delta=delta
    )
    expected = trace_mod.instance_traces([instance], params)[0]
    np.testing.assert_allclose(load_trace(requests, delta, horizon), expected)


@pytest.mark.parametrize(
    ("current", "previous", "expected"),
    [
        pytest.param(snapshot(decode_steps=10, decode_time_s=0.5), None, 0.05, id="first-report"),
        pytest.param(
            snapshot(decode_steps=30, decode_time_s=0.9),
            snapshot(decode_steps=10, decode_time_s=0.5),
            0.02,
            id="since-previous",
        ),
        pytest.param(
            snapshot(decode_steps=10, decode_time_s=0.5),
            snapshot(decode_steps=10, decode_time_s=0.5),
            0.05,
            id="idle-keeps-last-known-speed",
        ),
        pytest.param(snapshot(), None, 0.0, id="never-stepped"),
    ],
)
def test_mean_step_time(
    current: EngineStats, previous: EngineStats | None, expected: float
) -> None:
    assert mean_step_time(current, previous) == pytest.approx(expected)


@pytest.mark.parametrize(
    ("usage", "capacity", "used"),
    [(0.0, 1600, 0), (0.5, 1600, 800), (0.013, 1600, 16), (1.0, 1600, 1600)],
)
def test_capacity_and_used_tokens_are_block_granular(
    usage: float, capacity: int, used: int
) -> None:
    stats = snapshot(kv_usage=usage)
    assert (stats.capacity_tokens, stats.used_tokens) == (capacity, used)


@pytest.mark.parametrize(
    ("sampling", "expected"),
    [
        ({"max_tokens": 10, "temperature": 0.7, "top_p": 0.9}, True),
        ({"presence_penalty": 0.0, "repetition_penalty": 1.0}, True),
        # A true continuation carries the seeded stream and the generated tokens.
        ({"seed": 3}, True),
        ({"presence_penalty": 0.5}, True),
        ({"frequency_penalty": -0.1}, True),
        ({"repetition_penalty": 1.1}, True),
        ({"n": 2}, False),
        ({"logprobs": 1}, True),
        ({"structured_outputs": {"regex": "a+"}}, True),
        ({"logit_bias": {5: 1.0}}, True),  # bias does not depend on generated tokens
        ({"n": "lots"}, False),
    ],
)
def test_is_migratable(sampling: dict[str, object], expected: bool) -> None:
    assert is_migratable(sampling) is expected


def test_build_report() -> None:
    prev = snapshot(decode_steps=100, decode_time_s=1.0, preemptions=1)
    cur = snapshot(
        ts=5.0,
        kv_usage=0.25,
        running=(
            RunningRequest("a", prompt_tokens=40, generated=10),
            RunningRequest("b", prompt_tokens=5, generated=0, migratable=False),
        ),
        waiting=2,
        decode_steps=120,
        decode_time_s=1.4,
        preemptions=3,
    )
    report = build_report(
        cur,
        prev,
        instance="decode-0",
        role="decode",
        seq=7,
        ts=1700000000.0,
        address="127.0.0.1:9000",
        predictions={"a": 15.0, "gone": 3.0},
        delta=10,
        horizon=2,
        in_flight=["b"],
    )
    assert report == Report(
        instance="decode-0",
        role="decode",
        seq=7,
        ts=1700000000.0,
        address="127.0.0.1:9000",
        capacity_tokens=1600,
        used_tokens=400,
        bytes_per_token=512,
        step_time_s=pytest.approx(0.02),  # type: ignore[arg-type]
        delta=10,
        trace=[55.0, 75.0, 25.0],  # a: 50, 60, gone; b (no R-hat): 5, 15, 25
        requests=[
            RequestLoad("a", tokens=50, generated=10, predicted_remaining=15.0),
            RequestLoad("b", tokens=5, generated=0, predicted_remaining=None, migratable=False),
        ],
        in_flight=["b"],
        waiting=2,
        preemptions=3,
    )
    # And it survives the wire.
    assert decode_as(encode(report), Report) == report
    assert report.draining is False


@pytest.mark.parametrize("draining", [False, True])
def test_build_report_says_whether_the_worker_is_draining(draining: bool) -> None:
    report = build_report(
        snapshot(),
        None,
        instance="decode-0",
        role="decode",
        seq=1,
        ts=1700000000.0,
        address="127.0.0.1:9000",
        predictions={},
        delta=10,
        horizon=2,
        draining=draining,
    )
    assert report.draining is draining
    assert decode_as(encode(report), Report).draining is draining


def test_build_report_carries_the_refused_peer_count() -> None:
    report = build_report(
        snapshot(),
        None,
        instance="decode-0",
        role="decode",
        seq=1,
        ts=1700000000.0,
        address="127.0.0.1:9000",
        predictions={},
        delta=10,
        horizon=2,
        refused_peers=4,
    )
    assert decode_as(encode(report), Report).refused_peers == 4


FIXED = {"max_tokens": 100, "ignore_eos": True}


@pytest.mark.parametrize(
    ("sampling", "prompt", "expected"),
    [
        (FIXED, 10, 100),
        ({**FIXED, "temperature": 0.0, "min_tokens": 5, "top_p": 0.9, "seed": 3}, 10, 100),
        ({**FIXED, "stop": [], "stop_token_ids": None}, 10, 100),  # empty: nothing stops it
        ({**FIXED, "max_tokens": 4000}, 200, 3896),  # the context (4,096) ends it first
        ({**FIXED, "max_tokens": 4000}, 4096, 0),
        ({"max_tokens": 100}, 10, None),  # EOS may end it any time
        ({**FIXED, "ignore_eos": False}, 10, None),
        ({"ignore_eos": True}, 10, None),  # no max_tokens
        ({**FIXED, "max_tokens": True}, 10, None),
        # vLLM's check_stop still ends an ignore_eos request on these:
        ({**FIXED, "stop": ["\n"]}, 10, None),
        ({**FIXED, "stop_token_ids": [7]}, 10, None),
        ({**FIXED, "structured_outputs": {"json": {}}}, 10, None),
        ({**FIXED, "repetition_detection": {"max_pattern_size": 4}}, 10, None),
        ({**FIXED, "some_new_knob": 1}, 10, None),  # not known not to stop
    ],
)
def test_length_budget(sampling: dict[str, object], prompt: int, expected: int | None) -> None:
    assert length_budget(sampling, prompt, 4096) == expected


def test_true_remaining_is_budget_minus_generated_and_survives_a_migration() -> None:
    sampling = {"max_tokens": 100, "ignore_eos": True}
    first = RunningRequest(
        "r", prompt_tokens=10, generated=30, budget=length_budget(sampling, 10, 4096)
    )
    assert first.true_remaining == 70
    # Released after 30 tokens: the target continues with those in its prompt
    # and max_tokens reduced (the proxy's leg_frame), counting its own tokens.
    again = continuation(sampling, 30)
    second = RunningRequest(
        "r", prompt_tokens=40, generated=5, budget=length_budget(again, 40, 4096)
    )
    assert second.true_remaining == 65 == 100 - 30 - 5
    assert second.tokens == first.tokens + 5
    assert RunningRequest("x", 10, 3).true_remaining is None
    assert RunningRequest("x", 10, 120, budget=100).true_remaining == 0


@pytest.mark.parametrize("predictor", [None, False, True])
def test_build_report_carries_true_lengths_and_whether_a_predictor_is_loaded(
    predictor: bool | None,
) -> None:
    report = build_report(
        snapshot(
            running=(
                RunningRequest("fixed", prompt_tokens=10, generated=30, budget=100),
                RunningRequest("open", prompt_tokens=10, generated=30),
            )
        ),
        None,
        instance="decode-0",
        role="decode",
        seq=1,
        ts=1700000000.0,
        address="127.0.0.1:9000",
        predictions={},
        delta=10,
        horizon=2,
        predictor=predictor,
    )
    assert [(r.id, r.true_remaining) for r in report.requests] == [("fixed", 70), ("open", None)]
    assert report.predictor is predictor
    assert decode_as(encode(report), Report) == report
