"""The predictor's sans-engine parts: checkpoint, data directory, split, training, metrics."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from star.model import tiny_model_path
from star.predictor import evaluate as ev
from star.predictor import train as tr
from star.predictor.dataset import DataDir, DatasetError, Samples
from star.predictor.model import (
    CheckpointError,
    PredictorConfig,
    build_mlp,
    default_checkpoint,
    load_checkpoint,
    save_checkpoint,
)
from tests.predictor.helpers import synthetic
from workers.tap_client import external_id

# -- model and checkpoint ---------------------------------------------------------------


def test_default_mlp_has_the_papers_shape() -> None:
    model = build_mlp(3584, (2048, 512, 64))
    widths = [m.out_features for m in model.net if isinstance(m, torch.nn.Linear)]
    assert widths == [2048, 512, 64, 1]
    # Paper §5.3: "8.4 M parameters" for d = 3584.
    assert 8.3e6 < model.num_parameters() < 8.5e6


@pytest.mark.parametrize("log_target", [False, True])
def test_encode_decode_round_trip(log_target: bool) -> None:
    model = build_mlp(4, (8,), log_target=log_target, target_scale=50.0)
    remaining = torch.tensor([0.0, 1.0, 37.0, 1500.0])
    assert torch.allclose(model.decode(model.encode(remaining)), remaining, rtol=1e-5, atol=1e-3)


def test_decode_never_negative() -> None:
    model = build_mlp(4, (8,))
    assert float(model.decode(torch.tensor([-3.0])).item()) == 0.0


def test_checkpoint_round_trip(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = build_mlp(6, (16, 4), log_target=True, target_scale=80.0)
    model.set_normalisation(torch.arange(6.0), torch.full((6,), 2.0))
    save_checkpoint(model, tmp_path / "ck", {"model": "m", "hidden_size": 6})
    loaded = load_checkpoint(tmp_path / "ck")
    assert loaded.config == model.config
    assert loaded.metadata["model"] == "m"
    x = torch.randn(5, 6)
    assert torch.equal(loaded.model.predict(x), model.predict(x))
    # Either file of the pair names the checkpoint too.
    assert load_checkpoint(tmp_path / "ck" / "predictor.json").config == model.config


def test_missing_and_bad_checkpoints_say_what_is_wrong(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="no predictor checkpoint"):
        load_checkpoint(tmp_path / "nothing")
    save_checkpoint(build_mlp(3, (4,)), tmp_path, {})
    meta = json.loads((tmp_path / "predictor.json").read_text())
    meta["config"]["input_dim"] = 5
    (tmp_path / "predictor.json").write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match="bad predictor checkpoint"):
        load_checkpoint(tmp_path)
    meta["format"] = 99
    (tmp_path / "predictor.json").write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match="unknown format"):
        load_checkpoint(tmp_path)


@pytest.mark.parametrize(
    "bad",
    [
        {"input_dim": 0},
        {"input_dim": 4, "hidden_sizes": (0,)},
        {"input_dim": 4, "target_scale": 0.0},
        {"input_dim": 4, "decay": 1.5},
        {"input_dim": 4, "power": -1.0},
        {"input_dim": 4, "first_weight": 0.0},
    ],
)
def test_bad_configs_are_refused(bad: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        PredictorConfig(**bad)  # type: ignore[arg-type]


def test_checkpoints_from_before_fusion_load_as_their_average() -> None:
    # A format-1 checkpoint without "decay" had an EMA with weight alpha on the newest round.
    old = PredictorConfig.from_dict({"input_dim": 4, "hidden_sizes": [4], "alpha": 0.25})
    assert old.decay == pytest.approx(0.75) and not old.uncertainty
    s = synthetic(requests=3)
    pred = np.random.default_rng(0).uniform(0, 300, len(s))
    want = np.empty(len(s))  # the average those checkpoints served
    totals: dict[int, float] = {}
    for i in np.lexsort((s.generated, s.request)).tolist():
        r, g = int(s.request[i]), float(s.generated[i])
        t = pred[i] + g
        totals[r] = t if r not in totals else 0.75 * totals[r] + 0.25 * t
        want[i] = max(totals[r] - g, 0.0)
    got = ev.fused(s, pred, np.ones(len(s)), old.decay, old.power, old.first_weight)
    assert np.allclose(got, want)
    assert PredictorConfig.from_dict({"input_dim": 4, "hidden_sizes": [4]}).decay == 0.0
    with pytest.raises(ValueError, match="alpha"):
        PredictorConfig.from_dict({"input_dim": 4, "hidden_sizes": [4], "alpha": 0.0})


def test_uncertainty_checkpoint_round_trip(tmp_path: Path) -> None:
    model = build_mlp(6, (8,), log_target=True, uncertainty=True, decay=0.5, power=3.0)
    widths = [m.out_features for m in model.net if isinstance(m, torch.nn.Linear)]
    assert widths == [8, 2]
    save_checkpoint(model, tmp_path, {"model": "m"})
    loaded = load_checkpoint(tmp_path)
    assert loaded.config == model.config
    x = torch.randn(5, 6)
    for a, b in zip(loaded.model.predict_with_sigma(x), model.predict_with_sigma(x), strict=True):
        assert torch.equal(a, b)


def test_shipped_predictor_fits_the_tiny_model_and_beat_its_baselines() -> None:
    path = default_checkpoint(tiny_model_path())
    assert path is not None, "star/model/tiny/predictor/ is missing"
    ckpt = load_checkpoint(path)
    hidden = json.loads((tiny_model_path() / "config.json").read_text())["hidden_size"]
    assert ckpt.config.input_dim == hidden == ckpt.metadata["hidden_size"]
    assert ckpt.metadata["model"] == "tiny"
    m = ckpt.metadata["metrics"]
    # What the worker serves beats both baselines on held-out prompts.
    assert m["mlp-fused"]["mae"] < m["constant"]["mae"]
    assert m["mlp-fused"]["mae"] < m["prompt-only"]["mae"]
    assert ckpt.config.uncertainty and 0.0 <= ckpt.config.decay <= 1.0
    assert len(ckpt.metadata["data"]["hash"]) == 64


# -- data directory -------------------------------------------------------------------


META = {"model": "m", "hidden_size": 8, "workload": "synthetic", "seed": 0, "every": 20}


def test_data_dir_writes_shards_and_resumes(tmp_path: Path) -> None:
    s = synthetic(requests=10)
    first, second = s.take(s.request < 5), s.take(s.request >= 5)
    d = DataDir(tmp_path)
    d.start(META)
    d.append(first, 5, [{"n": i} for i in range(5)])
    digest = d.data_hash()
    # A new handle on the same directory resumes where the first left off.
    again = DataDir(tmp_path)
    again.start(META)
    assert again.next_request == 5 and again.rows == len(first)
    again.append(second, 10, [{"n": i} for i in range(5, 10)])
    loaded = DataDir(tmp_path).load()
    assert len(loaded) == len(s)
    assert np.array_equal(loaded.hidden, s.hidden)
    assert np.array_equal(loaded.remaining, s.remaining)
    assert DataDir(tmp_path).data_hash() != digest
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "index.json",
        "shard-00000.safetensors",
        "shard-00001.safetensors",
    ]


def test_resume_with_other_settings_is_refused(tmp_path: Path) -> None:
    DataDir(tmp_path).start(META)
    with pytest.raises(DatasetError, match="every"):
        DataDir(tmp_path).start({**META, "every": 5})


def test_loading_nothing_says_how_to_collect(tmp_path: Path) -> None:
    with pytest.raises(DatasetError, match="star predictor collect"):
        DataDir(tmp_path).load()


# -- split and training -----------------------------------------------------------------


def test_split_is_by_prompt_70_15_15() -> None:
    s = synthetic(requests=200)
    ids = tr.split_ids(s, seed=3)
    for p in np.unique(s.prompt):
        assert len(set(ids[s.prompt == p].tolist())) == 1  # a prompt (so a request) in one split
    prompts = [len(np.unique(s.prompt[ids == i])) for i in range(3)]
    assert prompts == [70, 15, 15]
    assert np.array_equal(ids, tr.split_ids(s, seed=3))


@pytest.fixture
def one_thread() -> object:
    """One torch thread: two fight each other on a loaded 2-core machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.mark.usefixtures("one_thread")
def test_training_learns_a_planted_signal_and_stops_early() -> None:
    data = tr.split(synthetic(requests=200), seed=0)
    cfg = tr.TrainConfig(hidden_sizes=(16,), lr=1e-2, batch_size=128, max_epochs=25, patience=4)
    best, results = tr.search([cfg], data, progress=False)
    assert best is results[0]
    rows = ev.evaluate(best.model, data["test"], data["train"])
    overall = ev.summary(rows)
    # Feature 0 carries remaining/100 +- 5 tokens: far better than any baseline.
    assert overall["mlp"]["mae"] < 25
    assert overall["mlp"]["mae"] < overall["constant"]["mae"] / 3
    assert overall["mlp"]["kendall_tau"] > 0.8
    assert best.epochs <= 25 and best.best_epoch <= best.epochs
    assert best.epochs - best.best_epoch <= cfg.patience


@pytest.mark.usefixtures("one_thread")
def test_the_scale_output_learns_which_rows_to_trust() -> None:
    s = synthetic(requests=200)
    rng = np.random.default_rng(1)
    # Half the rows (feature 1 > 0) carry remaining/100 with +-100 tokens of noise.
    noisy = s.hidden[:, 1] > 0
    s.hidden[noisy, 0] += rng.normal(scale=1.0, size=int(noisy.sum())).astype(np.float32)
    data = tr.split(s, seed=0)
    cfg = tr.TrainConfig(
        hidden_sizes=(16,), lr=1e-2, batch_size=128, max_epochs=25, patience=4, uncertainty=True
    )
    best, _ = tr.search([cfg], data, progress=False)
    test = data["test"]
    pred, sigma = ev.mlp_predictions(best.model, test)
    rough = test.hidden[:, 1] > 0
    assert np.median(sigma[rough]) > 2 * np.median(sigma[~rough])
    err = np.abs(pred - test.remaining)
    assert err[rough].mean() > 2 * err[~rough].mean()
    # The fusion chosen on validation is a valid one, and served beats the row alone.
    cfg = best.model.config
    assert cfg.decay in tr.DECAYS and cfg.power in tr.POWERS
    assert cfg.first_weight in tr.FIRST_WEIGHTS
    summary = ev.summary(ev.evaluate(best.model, test, data["train"]))
    assert summary["mlp-fused"]["mae"] < summary["mlp"]["mae"]


def test_training_needs_rows() -> None:
    empty = Samples.concat([], dim=4)
    with pytest.raises(ValueError, match="need rows"):
        tr.search([tr.TrainConfig()], {"train": empty, "val": empty, "test": empty}, progress=False)


def test_default_grid_varies_shape_lr_and_batch() -> None:
    grid = tr.default_grid(tr.TrainConfig())
    assert len({(c.hidden_sizes, c.lr, c.batch_size) for c in grid}) == len(grid) == 4
    assert {c.hidden_sizes for c in grid} == {(2048, 512, 64), (512, 64)}


# -- metrics and baselines -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("pred", "true", "mae", "nmae", "tau"),
    [
        ([1, 2, 3], [1, 2, 3], 0.0, 0.0, 1.0),
        ([3, 2, 1], [1, 2, 3], 4 / 3, 2 / 3, -1.0),
        ([10, 10, 10], [5, 10, 15], 10 / 3, 1 / 3, math.nan),
    ],
)
def test_metrics(pred: list[float], true: list[float], mae: float, nmae: float, tau: float) -> None:
    got = ev.metrics(np.array(pred, float), np.array(true, float))
    assert got[0] == pytest.approx(mae) and got[1] == pytest.approx(nmae)
    assert (math.isnan(got[2]) and math.isnan(tau)) or got[2] == pytest.approx(tau)


def test_fusion_with_equal_weights_averages_the_predicted_final_length() -> None:
    s = synthetic(requests=1, every=20)
    order = np.argsort(s.generated)
    g = s.generated[order].astype(float)
    # Rows predicting final lengths 100, 200, 300, ...: with equal weights the
    # served R-hat is their mean, the past fading by ``decay`` per round.
    pred = np.empty(len(s))
    pred[order] = 100.0 * (np.arange(len(s)) + 1) - g
    ones = np.ones(len(s))
    out = ev.fused(s, pred, ones, 0.5, 2.0)[order]
    assert out[0] == pytest.approx(100.0)
    assert out[1] == pytest.approx((0.5 * 100.0 + 200.0) / 1.5 - g[1])
    assert out[2] == pytest.approx((0.25 * 100.0 + 0.5 * 200.0 + 300.0) / 1.75 - g[2])
    assert np.array_equal(ev.fused(s, pred, ones, 0.0, 2.0), np.maximum(pred, 0.0))


def test_fusion_trusts_the_rounds_with_small_sigma() -> None:
    s = synthetic(requests=1, every=20)
    order = np.argsort(s.generated)
    g = s.generated[order].astype(float)
    pred = np.empty(len(s))
    pred[order] = 500.0 - g  # every round: final length 500 ...
    sigma = np.full(len(s), 1.0)
    pred[order[1]] = 5000.0 - g[1]  # ... but one, unsure of itself, says 5000
    sigma[order[1]] = 1000.0
    out = ev.fused(s, pred, sigma, 1.0, 2.0)[order]
    assert np.allclose(out[2:] + g[2:], 500.0, atol=0.01)


def test_clip_is_the_max_tokens_bound() -> None:
    s = synthetic(requests=3)
    pred = np.full(len(s), 300.0)
    out = ev.clip(pred, s, 250)
    assert np.array_equal(out, np.minimum(300.0, 250.0 - s.generated))
    assert ev.clip(pred, s, None) is pred


def test_prompt_only_ages_the_first_prediction() -> None:
    s = synthetic(requests=2)
    pred = np.full(len(s), 999.0)
    first = s.request == 0
    pred[np.flatnonzero(first)[0]] = 50.0  # request 0's progress-0 row says 50
    out = ev.prompt_only(s, pred)
    g = s.generated[first]
    assert np.array_equal(out[first], np.maximum(50.0 - g, 1.0))


@pytest.mark.parametrize(
    ("bins", "values", "mids"),
    [
        (2, [0, 10, 24.9, 25, 99, 500], [12.5, 12.5, 12.5, 62.5, 62.5, 62.5]),
        (4, [0, 12.5, 30, 60], [6.25, 18.75, 37.5, 75.0]),
    ],
)
def test_bins_scale_the_papers_edges(bins: int, values: list[float], mids: list[float]) -> None:
    edges = ev.bin_edges(bins, 100.0)
    assert edges[0] == 0 and edges[-1] == 100
    assert np.allclose(ev.quantise(np.array(values, float), edges), mids)


def test_buckets_partition_rows() -> None:
    s = synthetic(requests=50)
    s.final[s.request < 10] += ev.LONG  # some long answers
    got = dict(ev.buckets(s))
    progress = sum(m for k, m in got.items() if k.startswith("progress"))
    length = sum(m for k, m in got.items() if k.startswith("length"))
    long = np.sum([m for k, m in got.items() if k.startswith("long progress")], axis=0)
    assert np.all(progress == 1) and np.all(length == 1)
    assert np.array_equal(long, s.final >= ev.LONG) and long.any()
    assert np.array_equal(got["progress 0"], s.generated == 0)


@pytest.mark.parametrize(
    ("error_of_generated", "verdicts"),
    [
        # Error shrinking with progress (the paper's Fig. 7), growing, and the same throughout.
        (lambda g: 200.0 / (1.0 + g / 25.0), {"falls"}),
        (lambda g: 20.0 + g / 2.0, {"rises"}),
        (None, {"flat"}),  # every row 30 tokens off: no change at all
    ],
)
def test_trend_tells_a_falling_mae_from_noise(
    error_of_generated: object, verdicts: set[str]
) -> None:
    rng = np.random.default_rng(3)
    finals = rng.integers(20, 900, size=300)  # long answers reach every bucket
    req = np.concatenate([np.full(len(range(0, f, 20)), r) for r, f in enumerate(finals)])
    gen = np.concatenate([np.arange(0, f, 20) for f in finals])
    s = Samples(
        hidden=np.zeros((len(req), 1), dtype=np.float32),
        generated=gen,
        remaining=finals[req] - gen,
        final=finals[req],
        request=req,
        prompt=req // 2,
        capped=np.zeros(len(req), dtype=bool),
    )
    g = s.generated.astype(np.float64)
    if error_of_generated is None:
        err = np.full_like(g, 30.0)
    else:
        noise = np.random.default_rng(0).normal(scale=5.0, size=len(s))
        err = np.abs(error_of_generated(g) + noise)  # type: ignore[operator]
    sign = np.where(np.random.default_rng(1).random(len(s)) < 0.5, -1.0, 1.0)
    steps = ev.trend(s, s.remaining + sign * err, rounds=300)
    families = {st.family for st in steps}
    assert families == {"progress", "long progress"}
    whole = [st for st in steps if st.before.endswith(" 0") and st.after.endswith("400+")]
    assert len(whole) == 2  # the first bucket to the last, per family
    assert {st.verdict for st in whole} == verdicts
    for st in steps:
        assert st.low <= st.change <= st.high
    text = ev.format_trend(steps)
    assert "95 %" in text and text.count("\n") == len(steps)


def test_json_rows_have_the_issue_keys() -> None:
    s = synthetic(requests=40)
    rows = ev.as_dicts(ev.evaluate(build_mlp(8, (4,)), s, s))
    assert {tuple(sorted(r)) for r in rows} == {
        ("bucket", "kendall_tau", "mae", "nmae", "predictor", "samples")
    }
    assert {r["predictor"] for r in rows} == {
        "mlp-fused",
        "mlp",
        "constant",
        "prompt-only",
        "bins:6",
        "bins:4",
        "bins:2",
    }
    json.dumps(rows, allow_nan=False)  # NaN became null


def test_external_id_strips_vllms_suffix() -> None:
    assert external_id("req-1-abcd1234") == "req-1"
    assert external_id("plain") == "plain"
    assert external_id("a-short") == "a-short"
