"""The tap's worker side without an engine: a stand-in for vLLM's model runner.

The stand-in has exactly what ``workers.tap.HiddenStateTap`` reads from vLLM's
V1 model runner (input batch arrays, discard mask, cached request states,
``max_model_len``); ``tests/predictor/test_engine.py`` runs the same code in a
real engine. Here every number can be checked: the served R-hat must be the
evaluation's ``fused`` over the same rows, clipped to the request's cap.
"""

from __future__ import annotations

import types
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from star.predictor import evaluate as ev
from star.predictor.dataset import Samples
from star.predictor.model import (
    FastPredictor,
    LengthPredictor,
    PredictorConfig,
    fuse_step,
    save_checkpoint,
)
from workers.tap import CONTINUED_KEY, FUSION_KEY, HiddenStateTap

DIM = 8
PROMPT = 5


class FakeRunner:
    """The parts of vLLM's GPU/CPU model runner the tap reads, for ``slots`` rows."""

    def __init__(self, slots: int = 8, max_model_len: int = 4096) -> None:
        self.input_batch = types.SimpleNamespace(
            num_reqs=0,
            req_ids=[],
            num_prompt_tokens=np.zeros(slots, dtype=np.int32),
            num_computed_tokens_cpu=np.zeros(slots, dtype=np.int32),
            num_tokens_no_spec=np.zeros(slots, dtype=np.int32),
        )
        self.discard_request_mask = types.SimpleNamespace(np=np.zeros(slots, dtype=bool))
        self.requests: dict[str, Any] = {}
        self.max_model_len = max_model_len
        self.model_config = types.SimpleNamespace(get_hidden_size=lambda: DIM)
        self.model = types.SimpleNamespace(compute_logits=lambda h, *a, **k: "logits")
        self.device = torch.device("cpu")

    def execute_model(self, scheduler_output: Any) -> Any:
        """A model step: some work, then the logits of the sampled rows."""
        torch.randn(64, 64) @ torch.randn(64, 64)
        return self.model.compute_logits(scheduler_output.hidden)

    def step(
        self, hidden: torch.Tensor, new: tuple[str, ...] = (), resumed: tuple[str, ...] = ()
    ) -> Any:
        """One step the way vLLM drives it, scheduling ``new`` and ``resumed`` requests."""
        return self.execute_model(
            types.SimpleNamespace(
                scheduled_new_reqs=list(new),
                scheduled_cached_reqs=types.SimpleNamespace(resumed_req_ids=set(resumed)),
                hidden=hidden,
            )
        )

    def set_batch(self, reqs: list[tuple[str, int, bool, bool]]) -> None:
        """Rows in order: (id, tokens generated, prompt completes now, discarded)."""
        b = self.input_batch
        b.num_reqs = len(reqs)
        b.req_ids = [r[0] for r in reqs]
        for i, (_, gen, prompt_now, discard) in enumerate(reqs):
            b.num_prompt_tokens[i] = PROMPT
            b.num_computed_tokens_cpu[i] = PROMPT - 1 if prompt_now else PROMPT + gen - 1
            b.num_tokens_no_spec[i] = PROMPT + gen
            self.discard_request_mask.np[i] = discard


def _model(uncertainty: bool = True, decay: float = 0.6, power: float = 2.0) -> LengthPredictor:
    torch.manual_seed(3)
    cfg = PredictorConfig(DIM, (16,), True, 50.0, uncertainty, decay, power, first_weight=3.0)
    model = LengthPredictor(cfg)
    model.set_normalisation(torch.randn(DIM), torch.rand(DIM) + 0.5)
    last = model.net[-1]
    assert isinstance(last, torch.nn.Linear)
    with torch.no_grad():
        last.bias[0] = 2.0  # R-hat of a few hundred tokens
    return model.eval()


def _tap(tmp_path: Path, model: LengthPredictor, every: int, **runner_kw: Any) -> Any:
    save_checkpoint(model, tmp_path / "ckpt", {"model": "fake"})
    tap = HiddenStateTap()
    tap.model_runner = FakeRunner(**runner_kw)
    assert tap.star_tap_install(every, str(tmp_path / "ckpt")) == {
        "hidden_size": DIM,
        "predictor": True,
    }
    return tap


def _add(
    runner: FakeRunner,
    rid: str,
    max_tokens: int | None,
    continued: int = 0,
    fusion: list[float] | None = None,
) -> None:
    extra: dict[str, Any] | None = {CONTINUED_KEY: continued} if continued else None
    if extra is not None and fusion is not None:
        extra[FUSION_KEY] = fusion
    runner.requests[rid] = types.SimpleNamespace(
        num_prompt_tokens=PROMPT,
        sampling_params=types.SimpleNamespace(max_tokens=max_tokens, extra_args=extra),
    )


def test_fast_predictor_matches_the_module() -> None:
    for uncertainty in (False, True):
        model = _model(uncertainty)
        x = torch.randn(33, DIM)
        r_ref, s_ref = model.predict_with_sigma(x)
        r, s = FastPredictor(model)(x)
        assert np.allclose(r, r_ref.numpy(), rtol=1e-4, atol=1e-3)
        assert np.allclose(s, s_ref.numpy(), rtol=1e-4, atol=1e-3)
        assert np.all(r >= 0) and np.all(s > 0)


def test_fuse_step_decay_zero_is_the_last_round_and_weights_follow_sigma() -> None:
    state, served = fuse_step(None, 100.0, 10.0, 0, 0.0, 2.0)
    state, served = fuse_step(state, 30.0, 1000.0, 50, 0.0, 2.0)
    assert served == pytest.approx(30.0)
    # Equal decay, one sure and one unsure round: the sure one dominates.
    state, _ = fuse_step(None, 100.0, 1.0, 0, 1.0, 2.0)
    _, served = fuse_step(state, 500.0, 100.0, 20, 1.0, 2.0)
    assert served == pytest.approx((100.0 * 1 + 520.0 * 1e-4) / (1 + 1e-4) - 20)
    # Never negative.
    assert fuse_step(None, 0.0, 1.0, 10, 0.5, 2.0)[1] == 0.0


def test_tap_serves_the_evaluations_fusion_clipped_to_the_cap(tmp_path: Path) -> None:
    model = _model()
    every = 3
    tap = _tap(tmp_path, model, every)
    runner = tap.model_runner
    # "a": no max_tokens (cap = max_model_len - prompt); "b": max_tokens 12, so
    # the hard bound bites; "c" is discarded (a partial prefill) on every step.
    _add(runner, "a", None)
    _add(runner, "b", 12)
    _add(runner, "c", None)
    rng = np.random.default_rng(0)
    seen: dict[str, list[tuple[int, np.ndarray]]] = {"a": [], "b": []}
    step = 0
    for gen in range(0, 10):
        step += 1
        rows = [("a", gen, gen == 0, False), ("b", gen, gen == 0, False), ("c", 0, True, True)]
        runner.set_batch(rows)
        hidden = torch.from_numpy(rng.normal(size=(3, DIM)).astype(np.float32))
        assert runner.step(hidden, new=("a", "b", "c") if gen == 0 else ()) == "logits"
        if gen == 0 or step % every == 0:
            for i, rid in enumerate(("a", "b")):
                seen[rid].append((gen, hidden[i].numpy().copy()))
    got = tap.star_tap_predictions()
    assert set(got["requests"]) == {"a", "b"}  # "c" never sampled: never predicted
    # One prompt-completion round (step 1) plus the due steps 3, 6, 9.
    assert got["batches"] == 4 and got["rows"] == 8 and got["steps"] == 10
    assert got["predict_s"] > 0 and got["check_s"] > 0
    for rid, cap in (("a", 4096 - PROMPT), ("b", 12)):
        gens = np.array([g for g, _ in seen[rid]])
        samples = Samples.from_columns(
            np.stack([h for _, h in seen[rid]]),
            {
                "generated": gens,
                "remaining": np.ones_like(gens),
                "final": np.ones_like(gens),
                "request": np.zeros_like(gens),
                "prompt": np.zeros_like(gens),
                "capped": np.zeros_like(gens),
            },
        )
        pred, sigma = ev.mlp_predictions(model, samples)
        unclipped = ev.fused(samples, pred, sigma, 0.6, 2.0, 3.0)
        want = ev.clip(unclipped, samples, cap)
        r_hat, g, *_ = got["requests"][rid]
        assert g == gens[-1]
        assert r_hat == pytest.approx(max(want[-1], 0.0), rel=1e-4, abs=1e-3)
        if rid == "b":  # the bound bites: at most 12 - 9 tokens to go
            assert unclipped[-1] > 12 - g and r_hat == pytest.approx(12 - g)
        else:
            assert r_hat == pytest.approx(unclipped[-1], rel=1e-4)


def test_rows_a_numpy_view_cannot_hold_go_through_torch(tmp_path: Path) -> None:
    # On the host float32 rows are read as a numpy view; bfloat16 ones (a CPU
    # engine in bf16) cannot be: the tap notices once and serves from torch.
    model = _model()
    served = []
    for dtype in (torch.float32, torch.bfloat16):
        tap = _tap(tmp_path / str(dtype), model, every=2)
        runner = tap.model_runner
        _add(runner, "a", None)
        hidden = torch.linspace(-1, 1, DIM).repeat(1, 1)
        runner.set_batch([("a", 0, True, False)])
        runner.step(hidden.to(dtype), new=("a",))
        runner.set_batch([("a", 1, False, False)])
        runner.step(hidden.to(dtype))
        assert tap._star_tap.as_numpy == (dtype == torch.float32)
        got = tap.star_tap_predictions()
        assert got["batches"] == 2
        served.append(got["requests"]["a"][0])
    assert served[1] == pytest.approx(served[0], rel=0.05)


def test_a_request_moved_here_gets_no_prompt_weight_on_its_first_row(tmp_path: Path) -> None:
    # Two requests see the same rows; "moved" continues one that generated 120
    # tokens on another engine (the worker marks it, below), so its first row
    # here is mid-answer and weighs like any other round, not first_weight x.
    model = _model()
    tap = _tap(tmp_path, model, every=2)
    runner = tap.model_runner
    _add(runner, "fresh", None)
    _add(runner, "moved", None, continued=120)
    rng = np.random.default_rng(1)
    rows: list[tuple[int, np.ndarray]] = []
    for gen in range(0, 5):
        runner.set_batch([("fresh", gen, gen == 0, False), ("moved", gen, gen == 0, False)])
        h = torch.from_numpy(np.repeat(rng.normal(size=(1, DIM)).astype(np.float32), 2, axis=0))
        runner.step(h, new=("fresh", "moved") if gen == 0 else ())
        if gen == 0 or (gen + 1) % 2 == 0:
            rows.append((gen, h[0].numpy().copy()))
    gens = np.array([g for g, _ in rows])
    samples = Samples.from_columns(
        np.stack([x for _, x in rows]),
        {k: np.zeros_like(gens) for k in ("remaining", "final", "request", "prompt", "capped")}
        | {"generated": gens},
    )
    pred, sigma = ev.mlp_predictions(model, samples)
    got = tap.star_tap_predictions()["requests"]
    for rid, first in (("fresh", 3.0), ("moved", 1.0)):
        want = ev.fused(samples, pred, sigma, 0.6, 2.0, first)[-1]
        assert got[rid][0] == pytest.approx(want, rel=1e-4, abs=1e-3), rid
    assert got["fresh"][0] != pytest.approx(got["moved"][0], rel=1e-3)


def test_a_moved_request_continues_the_fusion_it_brings(tmp_path: Path) -> None:
    # "r" runs 6 steps on engine a, is moved with a's fusion state and runs 4
    # more on engine b: b must serve what one engine would have served over
    # all ten rows (b counts tokens from the continuation's prompt, the state
    # from the original one).
    model = _model()
    hidden = np.random.default_rng(2).normal(size=(10, DIM)).astype(np.float32)
    taken: list[int] = []  # the steps whose rows the taps took

    def run(tap: Any, steps: range) -> None:
        for step in steps:
            gen = step - steps.start
            tap.model_runner.set_batch([("r", gen, gen == 0, False)])
            tap.model_runner.step(
                torch.from_numpy(hidden[step : step + 1]), new=("r",) * (gen == 0)
            )
            if gen == 0 or (gen + 1) % 2 == 0:  # the prompt's row, then every 2nd step
                taken.append(step)

    a = _tap(tmp_path / "a", model, every=2)
    _add(a.model_runner, "r", None)
    run(a, range(0, 6))
    state = a.star_tap_predictions()["requests"]["r"][2:]  # what a's worker hands over
    b = _tap(tmp_path / "b", model, every=2)
    _add(b.model_runner, "r", None, continued=6, fusion=state)
    run(b, range(6, 10))
    gens = np.array(taken)
    samples = Samples.from_columns(
        hidden[gens],
        {k: np.zeros_like(gens) for k in ("remaining", "final", "request", "prompt", "capped")}
        | {"generated": gens},
    )
    pred, sigma = ev.mlp_predictions(model, samples)
    want = ev.fused(samples, pred, sigma, 0.6, 2.0, 3.0)[-1]
    served, generated, *state_b = b.star_tap_predictions()["requests"]["r"]
    assert generated == 3 and served == pytest.approx(want, rel=1e-4, abs=1e-3)
    # b's own state is in the original prompt's terms again, for a next move.
    assert state_b[1] / state_b[0] == pytest.approx(served + 6 + 3, rel=1e-6)
    # Without the state, the same rows on b start a fusion of their own.
    c = _tap(tmp_path / "c", model, every=2)
    _add(c.model_runner, "r", None, continued=6)
    run(c, range(6, 10))
    alone = c.star_tap_predictions()["requests"]["r"][0]
    assert alone != pytest.approx(want, rel=1e-3)


def test_a_due_round_forgets_finished_requests_and_collects_copies(tmp_path: Path) -> None:
    tap = _tap(tmp_path, _model(), every=2)
    runner = tap.model_runner
    for rid in ("a", "b"):
        _add(runner, rid, None)
    tap.star_tap_install(2, str(tmp_path / "ckpt"), collect=True)
    runner.set_batch([("a", 0, True, False), ("b", 0, True, False)])
    hidden = torch.ones(2, DIM)
    runner.step(hidden, new=("a", "b"))  # step 1: both prompts complete
    hidden.fill_(7.0)  # vLLM reuses its buffers: what was collected must be a copy
    runner.set_batch([("a", 1, False, False)])  # "b" finished
    runner.step(torch.zeros(1, DIM))  # step 2: a due round
    assert set(tap.star_tap_predictions()["requests"]) == {"a"}
    drained = tap.star_tap_drain()
    assert drained["ids"] == ["a", "b", "a"]
    assert drained["generated"] == [0, 0, 1] and drained["prompt"] == [PROMPT] * 3
    rows = np.frombuffer(drained["hidden"], dtype=np.float32).reshape(-1, DIM)
    assert np.all(rows[:2] == 1.0) and np.all(rows[2] == 0.0)
    assert tap.star_tap_drain()["ids"] == []


def test_without_predictor_or_collection_the_wrapper_only_counts(tmp_path: Path) -> None:
    tap = HiddenStateTap()
    tap.model_runner = FakeRunner()
    tap.star_tap_install(1)
    tap.model_runner.set_batch([("a", 0, True, False)])
    tap.model_runner.step(torch.zeros(1, DIM), new=("a",))
    got = tap.star_tap_predictions()
    assert got["steps"] == 1 and got["batches"] == 0 and got["requests"] == {}
    assert got["predict_s"] == 0.0 and got["check_s"] == 0.0


def test_profile_counts_thread_cpu_of_the_tap_within_the_steps(tmp_path: Path) -> None:
    tap = _tap(tmp_path, _model(), every=2)
    runner = tap.model_runner
    _add(runner, "a", None)
    runner.set_batch([("a", 0, True, False)])
    runner.step(torch.zeros(1, DIM), new=("a",))
    got = tap.star_tap_predictions()
    assert got["tap_cpu_s"] == 0.0 and got["step_cpu_s"] == 0.0  # off by default
    tap.star_tap_install(2, str(tmp_path / "ckpt"), profile=True)
    for gen in range(1, 40):
        runner.set_batch([("a", gen, False, False)])
        assert runner.step(torch.zeros(1, DIM)) == "logits"
    got = tap.star_tap_predictions()
    assert 0.0 < got["tap_cpu_s"] < got["step_cpu_s"]
    assert got["predict_s"] + got["check_s"] < got["step_s"]


def test_between_rounds_the_tap_looks_only_after_a_step_schedules_a_new_request(
    tmp_path: Path,
) -> None:
    """Paper §5.3: the tap "costs nothing on the other steps" -- it checks for a
    completing prompt only after vLLM schedules a new or resumed request."""
    tap = _tap(tmp_path, _model(), every=1000)
    runner = tap.model_runner
    for rid in ("a", "b", "c", "d"):
        _add(runner, rid, None)
    runner.set_batch([("a", 0, True, False)])
    runner.step(torch.zeros(1, DIM), new=("a",))  # a's prompt completes: its first round
    runner.set_batch([("a", 1, False, False)])
    runner.step(torch.zeros(1, DIM))  # one check finds no prompt left to complete
    quiet = tap.star_tap_predictions()
    assert quiet["batches"] == 1 and quiet["check_s"] > 0
    for gen in range(2, 30):
        runner.set_batch([("a", gen, False, False)])
        runner.step(torch.zeros(1, DIM))
    got = tap.star_tap_predictions()
    assert got["check_s"] == quiet["check_s"] and got["batches"] == 1  # nothing done
    assert got["steps"] == 30
    # "b" arrives: the step that schedules it has the tap look, and b's prompt row is taken.
    runner.set_batch([("a", 30, False, False), ("b", 0, True, False)])
    runner.step(torch.zeros(2, DIM), new=("b",))
    got = tap.star_tap_predictions()
    assert set(got["requests"]) == {"a", "b"} and got["batches"] == 2
    assert got["requests"]["b"][1] == 0
    # A request resumed after preemption counts too ("c" recomputes its prompt here).
    runner.set_batch([("a", 31, False, False), ("b", 1, False, False), ("c", 0, True, False)])
    runner.step(torch.zeros(3, DIM), resumed=("c",))
    assert set(tap.star_tap_predictions()["requests"]) == {"a", "b", "c"}
    # A scheduler output the watcher cannot read: the tap checks on every step.
    runner.set_batch([("a", 32, False, False), ("d", 0, True, False)])
    runner.execute_model(types.SimpleNamespace(hidden=torch.zeros(2, DIM)))
    assert set(tap.star_tap_predictions()["requests"]) == {"a", "b", "c", "d"}
