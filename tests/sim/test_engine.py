"""The simulator: conservation, determinism, hand-computed scenarios, preemption,
migration, and the paper's ordering of modes (§6.3, Fig. 10)."""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

import numpy as np
import pytest

from star.planner.types import PlannerParams
from star.sim import ConfigError, SimConfig, SimResult, Workload, simulate
from star.sim.engine import Simulator

# A tiny cluster whose numbers are easy to follow by hand: constant 10 ms
# iterations, 0.1 s prefill, a 50 ms P->D handoff (1 byte per token at 1 GB/s
# adds nanoseconds).
HAND = SimConfig(
    decode_instances=2,
    prefill_instances=1,
    duration_s=5.0,
    mode="no-migration",
    dispatch="round-robin",
    step_base_s=0.01,
    step_per_token_s=0.0,
    prefill_base_s=0.1,
    prefill_per_token_s=0.0,
    bytes_per_token=1,
    bandwidth_gbps=8.0,
    handoff_latency_s=0.05,
    drain=True,
)


def _trace(prompts: list[int], outputs: list[int], arrivals: list[float]) -> Workload:
    return Workload("hand", np.array(prompts), np.array(outputs), np.array(arrivals))


def test_two_instances_by_hand() -> None:
    res = simulate(HAND, _trace([10, 10, 10], [101, 51, 21], [0.0, 0.0, 0.305]))
    log = res.requests
    eps = 11e-9  # 11 bytes at 1e9 bytes/s
    # A: prefill 0..0.1 (first token), handoff to d0 by 0.15, 100 iterations.
    # B: FIFO behind A on the one prefill instance: 0.1..0.2; d1 from 0.25, 50 iterations.
    # C: prefill 0.305..0.405; reaches d0 at 0.455, joins at d0's next boundary
    #    (0.46) and runs 20 iterations alongside A.
    assert log.ttft_s.tolist() == pytest.approx([0.1, 0.2, 0.1])
    assert log.finish.tolist() == pytest.approx([1.15 + eps, 0.75 + eps, 0.66 + eps], abs=1e-9)
    assert log.tpot_s().tolist() == pytest.approx([1.05 / 100, 0.55 / 50, 0.255 / 20], abs=1e-9)
    assert res.row["finished"] == 3 and res.row["preemptions"] == 0 and res.row["migrations"] == 0


def test_iteration_time_grows_with_the_batch() -> None:
    a, b = 0.008, 1e-5
    cfg = dataclasses.replace(HAND, decode_instances=1, step_base_s=a, step_per_token_s=b)
    res = simulate(cfg, _trace([10], [101], [0.0]))
    # 100 iterations starting at 11 tokens (prompt + first token), one more each.
    decode = sum(a + b * (11 + j) for j in range(100))
    assert res.requests.finish[0] == pytest.approx(0.15 + 11e-9 + decode, abs=1e-9)


# One decode instance of 1,000 tokens and two 600-token answers: it runs out.
CRAMPED = dataclasses.replace(
    HAND,
    decode_instances=1,
    prefill_instances=2,
    kv_capacity_tokens=1000,
    prefill_per_token_s=1e-4,
    duration_s=20.0,
)
TWO_LONG = _trace([100, 100], [600, 600], [0.0, 0.001])


def test_preemption_when_kv_capacity_is_exceeded() -> None:
    res = simulate(CRAMPED, TWO_LONG)
    log = res.requests
    eps = 101e-9
    # Prefill 0.11 s each (in parallel); A decodes from 0.16, B joins at A's next
    # boundary 0.17. Together 202 + 1 tokens grow by 2 per 10 ms iteration until
    # the next one would not fit in 1,000: after 398 iterations (4.15 s) the newest,
    # B, is preempted with 499 tokens; A finishes its 200 remaining iterations
    # alone (6.15 s); B is readmitted, recomputes 499 tokens at prefill speed and
    # runs its 201 remaining iterations.
    assert log.preemptions.tolist() == [0, 1]
    assert res.preemption_times.tolist() == pytest.approx([4.15 + eps], abs=1e-9)
    assert log.finish[0] == pytest.approx(6.15 + eps, abs=1e-9)
    assert log.finish[1] == pytest.approx(6.15 + eps + 499 * 1e-4 + 2.01, abs=1e-9)
    assert log.generated.tolist() == [600, 600]
    assert res.row["max_kv_usage"] <= 1.0


def test_kv_in_blocks_preempts_sooner() -> None:
    # The same two requests with vLLM-like 128-token blocks: each running request
    # also holds the rest of its last block, (128 - 1) // 2 = 63 tokens on average,
    # so the 1,000 tokens run out 63 iterations (2 x 63 tokens at 2 per iteration) sooner.
    exact = simulate(CRAMPED, TWO_LONG)
    blocks = simulate(dataclasses.replace(CRAMPED, kv_block_tokens=128), TWO_LONG)
    assert blocks.requests.preemptions.tolist() == [0, 1]
    assert blocks.preemption_times.tolist() == pytest.approx(
        [exact.preemption_times[0] - 0.63], abs=1e-6
    )
    assert blocks.requests.generated.tolist() == [600, 600]


def test_requests_that_can_never_fit_are_rejected() -> None:
    cfg = dataclasses.replace(HAND, kv_capacity_tokens=500)
    res = simulate(cfg, _trace([100, 450], [50, 100], [0.0, 0.1]))
    assert res.row["rejected"] == 1
    assert np.isfinite(res.requests.finish[0]) and np.isnan(res.requests.finish[1])


def test_with_blocks_a_request_that_only_fits_token_exact_is_rejected() -> None:
    # 400 + 50 + 1 tokens fit in 500 exactly, not with 63 more for its last block:
    # admitted, it would preempt itself for ever (a drained run would never end).
    cfg = dataclasses.replace(HAND, kv_capacity_tokens=500, kv_block_tokens=128)
    res = simulate(cfg, _trace([100, 400], [50, 50], [0.0, 0.1]))
    assert res.row["rejected"] == 1 and res.row["preemptions"] == 0
    assert np.isfinite(res.requests.finish[0]) and np.isnan(res.requests.finish[1])


# d0 gets A and C (300-token prompts, 1,500 tokens to go), d1 gets B (900, 400):
# d0 is the overloaded one, d1 is nearly full until B finishes (4.24 s).
PACKED = dataclasses.replace(
    HAND, mode="oracle", kv_capacity_tokens=2000, kv_block_tokens=128, duration_s=30.0
)
PACKED_TRACE = _trace([300, 900, 300], [1500, 400, 1500], [0.0, 0.0, 0.0])


def test_block_aware_planning_does_not_move_onto_a_target_that_then_preempts() -> None:
    # At the 1 s tick B holds ~976 tokens with 325 to go, C ~366. Token-exact, C
    # fits on d1 (976 + 366 + 2 x 320 = 1,982 <= 2,000 at the last grid point
    # before B ends), so C moves; but each running request also holds 63 tokens
    # of its last block, and at 3.69 s d1 runs out and preempts C.
    exact = simulate(PACKED, PACKED_TRACE)
    assert exact.requests.migrations.tolist() == [0, 0, 1]
    assert exact.requests.preemptions.tolist() == [0, 0, 1]
    assert exact.migration_times.tolist() == [1.0]
    assert exact.preemption_times[0] > exact.migration_times[0]
    assert exact.row["preemptions_of_moved"] == 1  # the moved request is the one preempted
    # Seeing 63 more tokens per request (2,108 > 2,000), the planner waits until
    # B is gone and moves then: nothing is preempted.
    blocks = simulate(dataclasses.replace(PACKED, plan_kv_blocks=True), PACKED_TRACE)
    assert blocks.row["migrations"] == 1 and blocks.row["preemptions"] == 0
    assert blocks.row["preemptions_of_moved"] == 0
    assert blocks.migration_times[0] > blocks.requests.finish[1]
    assert blocks.requests.generated.tolist() == [1500, 400, 1500]


def test_block_aware_planning_changes_nothing_without_blocks() -> None:
    exact = dataclasses.replace(PACKED, kv_block_tokens=1)
    a = simulate(exact, PACKED_TRACE)
    b = simulate(dataclasses.replace(exact, plan_kv_blocks=True), PACKED_TRACE)
    timing = {"wall_seconds", "cpu_seconds"}
    assert {k: v for k, v in a.row.items() if k not in timing} == {
        k: v for k, v in b.row.items() if k not in timing
    }
    assert a.requests.finish.tolist() == b.requests.finish.tolist()


def _drained(mode: str, **changes: Any) -> tuple[Simulator, SimResult]:
    cfg = SimConfig(
        decode_instances=6,
        duration_s=300.0,
        mode=mode,
        seed=5,
        drain=True,
        rate_rps=0.5,
        kv_capacity_tokens=60_000,
    )
    cfg = dataclasses.replace(cfg, **changes)
    sim = Simulator(cfg)
    return sim, sim.run()


@pytest.mark.parametrize("mode", ["no-migration", "predicted", "oracle"])
def test_conservation_every_token_and_request_accounted_for(mode: str) -> None:
    sim, res = _drained(mode)
    log = res.requests
    arrived = log.arrival.size
    assert arrived > 100
    # Every request finished exactly once (none lost, none twice), after its first token.
    assert bool(np.all(np.isfinite(log.finish)))
    assert sim.completions == arrived and sim.open == 0
    assert bool(np.all(log.finish >= log.arrival + log.ttft_s - 1e-12))
    fleet = sim.fleet
    assert all(not r for r in fleet.running) and not any(fleet.waiting) and not any(fleet.incoming)
    # Every generated token is one a decode iteration (or the prefill) produced.
    assert sim.tokens_generated == int(log.output.sum()) == int(log.generated.sum())
    # KV fully released, nothing held for migrations.
    for state in (fleet.batch, fleet.tokens_base_sum, fleet.reserved):
        assert list(state) == [0] * fleet.size
    assert sim.requests.source == [-1] * sim.requests.size  # no migration in flight


def test_conservation_with_preemptions_and_migrations() -> None:
    sim, res = _drained("current", kv_capacity_tokens=40_000, rate_rps=0.8)
    log = res.requests
    assert res.row["preemptions"] > 0 and res.row["migrations"] > 0
    assert bool(np.all(np.isfinite(log.finish)))
    assert sim.tokens_generated == int(log.output.sum())
    assert int(log.preemptions.sum()) == res.row["preemptions"]
    moved = int(log.preemptions[log.migrations > 0].sum())
    assert res.row["preemptions_of_moved"] == moved <= res.row["preemptions"]


def test_same_seed_same_run_other_seed_other_run() -> None:
    cfg = SimConfig(decode_instances=8, duration_s=300.0, mode="predicted", seed=3)
    a, b = simulate(cfg), simulate(cfg)
    c = simulate(dataclasses.replace(cfg, seed=4))
    keys = [k for k in a.row if k not in ("wall_seconds", "cpu_seconds")]
    assert {k: a.row[k] for k in keys} == {k: b.row[k] for k in keys}
    for name, series in a.series.items():
        assert np.array_equal(series, b.series[name]), name
    assert np.array_equal(a.migration_times, b.migration_times)
    assert a.row["exec_time_variance"] != c.row["exec_time_variance"]


@pytest.mark.parametrize("mode", ["predicted", "current", "oracle", "bins:4"])
def test_planner_gate_changes_nothing(mode: str) -> None:
    cfg = SimConfig(decode_instances=8, duration_s=400.0, mode=mode, seed=2, rate_per_8=0.45)
    gated, full = simulate(cfg), simulate(dataclasses.replace(cfg, gate=False))
    assert gated.row["planner_calls"] <= full.row["planner_calls"]
    assert np.array_equal(gated.migration_times, full.migration_times)
    assert gated.row["exec_time_variance"] == full.row["exec_time_variance"]


def test_a_migration_pauses_the_request_for_the_transfer() -> None:
    # Round-robin puts A and C on d0, B on d1; C's long prompt makes d0 the
    # overloaded one and the planner (current mode) moves a request to d1.
    bpt, gbps, latency = 50_000, 8.0, 0.025  # 1 GB/s: 50 us per token
    cfg = dataclasses.replace(
        HAND,
        mode="current",
        bytes_per_token=bpt,
        bandwidth_gbps=gbps,
        handoff_latency_s=latency,
        duration_s=30.0,
    )
    w = _trace([100, 100, 5000], [1500, 1500, 1500], [0.0, 0.01, 0.02])
    res = simulate(cfg, w)
    log = res.requests
    assert res.row["migrations"] == 1
    moved = int(np.flatnonzero(log.migrations)[0])
    # Unmigrated, a request decodes its 1,499 iterations in 14.99 s after its
    # handoff; a migrated one additionally waits for its KV transfer (tokens x
    # bytes / bandwidth + latency) and up to one iteration on each side.
    handoff = np.array([(p + 1) * bpt / 1e9 + latency for p in (100, 100, 5000)])
    start = log.arrival + log.ttft_s + handoff
    stall = (log.finish - start) - 14.99
    others = [i for i in range(3) if i != moved]
    assert stall[others] == pytest.approx([0.0, 0.0], abs=0.011)
    t_mig = float(res.migration_times[0])
    tokens = int(w.prompt_tokens[moved]) + 1 + round((t_mig - start[moved]) / 0.01)
    transfer = tokens * bpt / 1e9 + latency
    assert transfer - 0.001 <= stall[moved] <= transfer + 0.021


def test_a_migration_costs_its_own_latency_and_a_handoff_keeps_its_own() -> None:
    cfg = dataclasses.replace(
        HAND,
        mode="current",
        bytes_per_token=50_000,
        handoff_latency_s=0.025,
        migration_latency_s=0.5,
        duration_s=30.0,
    )
    w = _trace([100, 100, 5000], [1500, 1500, 1500], [0.0, 0.01, 0.02])
    res = simulate(cfg, w)
    log = res.requests
    assert res.row["migrations"] == 1
    moved = int(np.flatnonzero(log.migrations)[0])
    handoff = np.array([(p + 1) * 50_000 / 1e9 + 0.025 for p in (100, 100, 5000)])
    stall = (log.finish - (log.arrival + log.ttft_s + handoff)) - 14.99
    t_mig = float(res.migration_times[0])
    start = float(log.arrival[moved] + log.ttft_s[moved] + handoff[moved])
    tokens = int(w.prompt_tokens[moved]) + 1 + round((t_mig - start) / 0.01)
    transfer = tokens * 50_000 / 1e9 + 0.5
    assert transfer - 0.001 <= stall[moved] <= transfer + 0.021
    assert stall[[i for i in range(3) if i != moved]] == pytest.approx([0.0, 0.0], abs=0.011)


@pytest.mark.parametrize(("max_migrations", "margin"), [(1, 0.95), ("auto", 0.99)])
def test_ordering_of_modes_on_16_instances(
    max_migrations: int | Literal["auto"], margin: float
) -> None:
    """Paper §6.3 / Fig. 10: variance(predicted) < variance(current) < variance(vLLM),
    oracle no worse than predicted, at the default load and tick.

    2,000 simulated seconds: the first ~500 s are the ramp-up while the long
    (up to 32K-token) requests accumulate. Deterministic for the seeds; the
    margins are those measured over seeds 1-3 (docs/simulator.md). With one
    move per tick (the paper's M = 1) prediction helps most; with ``auto``
    every overloaded instance may shed a request each tick, balancing the
    present keeps up better and prediction's edge is smaller.
    """
    planner = dataclasses.replace(PlannerParams(), max_migrations=max_migrations)
    base = SimConfig(decode_instances=16, duration_s=2000.0, planner=planner)
    var: dict[str, float] = {}
    for mode in ("no-migration", "current", "predicted", "oracle"):
        runs = [simulate(dataclasses.replace(base, mode=mode, seed=s)) for s in (1, 2)]
        var[mode] = float(np.mean([r.row["exec_time_variance"] for r in runs]))
    assert var["predicted"] < margin * var["current"], var
    assert var["current"] < 0.05 * var["no-migration"], var
    assert var["oracle"] <= 1.05 * var["predicted"], var


def test_current_load_dispatch_answers_like_choose_decode_on_all_instances() -> None:
    from star.planner import Instance, Request
    from star.planner.dispatch import choose_decode

    sim = Simulator(SimConfig(decode_instances=32, duration_s=10.0))
    rng = np.random.default_rng(0)
    for trial in range(200):
        # Few distinct values: many ties, and sometimes nothing fits.
        load = rng.choice([0.0, 5e3, 9e4, 199_990.0], size=32).astype(np.float64)
        sim.view_load = load.copy()
        r = trial % sim.requests.size if sim.requests.size else 0
        tokens = int(sim.requests.prompt[r]) + 1 if sim.requests.size else 1
        full = [
            Instance(f"d{i}", (Request(f"d{i}", int(load[i])),), sim.capacity, sim.bytes_per_token)
            for i in range(32)
        ]
        want = choose_decode("current-load", full, tokens, None, sim.params, 0)
        assert sim.fleet.ids[sim._dispatch(r, 0.0)] == want


@pytest.mark.parametrize("dispatch", ["round-robin", "current-load", "predicted"])
def test_every_dispatch_policy_runs_and_conserves(dispatch: str) -> None:
    sim, res = _drained("predicted", dispatch=dispatch, duration_s=150.0)
    log = res.requests
    assert bool(np.all(np.isfinite(log.finish)))
    assert sim.tokens_generated == int(log.output.sum())


def test_booking_the_expected_footprint_shrinks_the_herd_between_views() -> None:
    # current-load on a view refreshed once a tick: booked at the prompt
    # alone, the least loaded instance takes the tick's arrivals until their
    # prompts catch up; booked at prompt + the mean output finished so far,
    # fewer requests land on one instance between two views.
    rows = {
        charge: simulate(
            SimConfig(
                decode_instances=256, duration_s=300.0, mode="no-migration", dispatch_charge=charge
            )
        ).row
        for charge in ("prompt", "expected")
    }
    assert rows["expected"]["herd_mean"] < 0.7 * rows["prompt"]["herd_mean"], rows
    assert rows["expected"]["herd_max"] < rows["prompt"]["herd_max"], rows


def test_round_robin_spreads_requests_evenly() -> None:
    cfg = dataclasses.replace(HAND, decode_instances=3, duration_s=60.0)
    n = 30
    res = simulate(cfg, _trace([10] * n, [5] * n, [0.2 * i for i in range(n)]))
    assert res.row["finished"] == n
    sim = Simulator(cfg, _trace([10] * n, [5] * n, [0.2 * i for i in range(n)]))
    picks = [sim._dispatch(r, 0.0) for r in range(n)]
    assert picks == [i % 3 for i in range(n)]


def test_length_only_file_workloads_are_sampled_at_the_configured_rate() -> None:
    w = Workload("file", np.array([10, 200, 3000]), np.array([5000, 100, 20000]))
    res = simulate(SimConfig(decode_instances=4, duration_s=300.0, rate_rps=0.5), w)
    assert res.row["arrived"] == pytest.approx(150, rel=0.3)
    assert set(res.requests.output.tolist()) <= {5000, 100, 20000}


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"mode": "bins:3"}, "bins takes 2, 4 or 6"),
        ({"workload": "lmsys"}, "must be one of sharegpt, alpaca"),
        ({"tick_s": 0.0}, "tick_s=0.0: must be > 0"),
        ({"dispatch": "random"}, "must be one of round-robin"),
        ({"dispatch_charge": "flat"}, "must be one of expected, prompt"),
        ({"warmup_s": 5000.0}, "must be below duration_s"),
        ({"migration_latency_s": -1.0}, "migration_latency_s=-1.0: must be >= 0"),
        ({"kv_block_tokens": 0}, "kv_block_tokens=0: must be > 0"),
        ({"duration_s": float("inf")}, "duration_s=inf: must be > 0 \\(a finite number\\)"),
        ({"predict_every": 2.5}, "predict_every=2.5: expected an integer"),
        ({"planner": PlannerParams(max_migrations=0)}, "max_migrations=0: must be"),
    ],
)
def test_config_errors_quote_the_bad_value(changes: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        SimConfig(**changes)
