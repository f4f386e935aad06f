"""``star predictor train``: fit the MLP on collected rows (paper §4.2, docs/design.md §6).

* Split by prompt, 70/15/15 (train/validation/test): every sample of a
  prompt is in one split, so no request spans two and the test set holds
  prompts the predictor never saw.
* L1 loss on the (scaled or log) remaining length, AdamW, early stopping on
  the validation MAE in tokens with patience 10 epochs; the best epoch's
  weights are kept.
* A small hyperparameter search over depth/width, learning rate and batch
  size, as the paper did ("we tune the hyperparameters ... using grid
  search"): every configuration trains to early stopping and the one with the
  lowest validation MAE wins. The test split is only read by the evaluation.
* With ``uncertainty`` (the default of ``star predictor train``) the MLP has a
  second output, log b, trained with the Laplace negative log-likelihood
  |y - mu| / b + log b of the first output's (detached) error in the
  target's encoding, so that it learns how far off each row's R-hat tends to
  be while the first output is fitted by the L1 loss alone. Then the served fusion over rounds
  (``decay``, ``power``: :func:`star.predictor.model.fuse_step`) is chosen on
  the validation split.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from star.predictor import evaluate as ev
from star.predictor.dataset import DataDir, Samples
from star.predictor.model import LengthPredictor, PredictorConfig, save_checkpoint

SPLITS = ("train", "val", "test")


@dataclass(frozen=True)
class TrainConfig:
    """One training run's hyperparameters."""

    hidden_sizes: tuple[int, ...] = (2048, 512, 64)
    lr: float = 1e-3
    batch_size: int = 256
    weight_decay: float = 1e-2
    max_epochs: int = 200
    patience: int = 10
    log_target: bool = False
    uncertainty: bool = False
    seed: int = 0

    def label(self) -> str:
        shape = "-".join(map(str, self.hidden_sizes))
        flags = (" log" if self.log_target else "") + (" +b" if self.uncertainty else "")
        return f"{shape} lr={self.lr:g} bs={self.batch_size}{flags}"


def default_grid(base: TrainConfig) -> list[TrainConfig]:
    """The search: the given shape, then a shallower net at two learning rates and batch sizes.

    Four runs, so that a search fits a few minutes on two CPU cores: depth and
    width (the given shape vs 512 -> 64), learning rate (x1, x0.3) and batch
    size (x1, x4) each vary once around the shallow net.
    """
    small = (512, 64)
    variants = [
        (base.hidden_sizes, base.lr, base.batch_size),
        (small, base.lr, base.batch_size),
        (small, base.lr * 0.3, base.batch_size),
        (small, base.lr, base.batch_size * 4),
    ]
    return [
        dataclasses.replace(base, hidden_sizes=shape, lr=lr, batch_size=bs)
        for shape, lr, bs in dict.fromkeys(variants)
    ]


def split_ids(
    samples: Samples, seed: int = 0, fractions: tuple[float, float] = (0.7, 0.15)
) -> npt.NDArray[np.int8]:
    """0/1/2 (train/val/test) per row, assigned by prompt: a prompt's rows share a split."""
    prompts = np.unique(samples.prompt)
    order = np.random.default_rng(seed).permutation(prompts)
    n = len(order)
    n_train = round(n * fractions[0])
    n_val = round(n * fractions[1])
    which = np.full(n, 2, dtype=np.int8)
    which[:n_train] = 0
    which[n_train : n_train + n_val] = 1
    of_prompt = dict(zip(order.tolist(), which.tolist(), strict=True))
    return np.array([of_prompt[p] for p in samples.prompt.tolist()], dtype=np.int8)


def split(samples: Samples, seed: int = 0) -> dict[str, Samples]:
    ids = split_ids(samples, seed)
    return {name: samples.take(ids == i) for i, name in enumerate(SPLITS)}


@dataclass
class TrainResult:
    config: TrainConfig
    model: LengthPredictor
    val_mae: float
    epochs: int
    best_epoch: int
    seconds: float
    history: list[float] = field(default_factory=list)


def _mae(model: LengthPredictor, x: torch.Tensor, y: torch.Tensor) -> float:
    with torch.inference_mode():
        pred = model.decode(model(x))
    return float((pred - y).abs().mean())


def train_one(
    cfg: TrainConfig, train: Samples, val: Samples, target_scale: float, progress: Any = None
) -> TrainResult:
    """Train one configuration to early stopping; returns the best-validation model."""
    torch.manual_seed(cfg.seed)
    t0 = time.monotonic()
    x = torch.from_numpy(train.hidden)
    y = torch.from_numpy(train.remaining.astype(np.float32))
    xv = torch.from_numpy(val.hidden)
    yv = torch.from_numpy(val.remaining.astype(np.float32))
    model = LengthPredictor(
        PredictorConfig(train.dim, cfg.hidden_sizes, cfg.log_target, target_scale, cfg.uncertainty)
    )
    model.set_normalisation(x.mean(0), x.std(0))
    target = model.encode(y)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    gen = torch.Generator().manual_seed(cfg.seed)
    best = math.inf
    best_state: dict[str, torch.Tensor] = copy.deepcopy(model.state_dict())
    best_epoch = 0
    history: list[float] = []
    epoch = 0
    for epoch in range(1, cfg.max_epochs + 1):
        model.train()
        order = torch.randperm(len(train), generator=gen)
        for idx in order.split(cfg.batch_size):  # type: ignore[no-untyped-call]
            out = model.forward_all(x[idx])
            err = (out[:, 0] - target[idx]).abs()
            loss = err.mean()
            if cfg.uncertainty:  # Laplace NLL of the (detached) error: the scale alone
                log_b = out[:, 1]
                loss = loss + (err.detach() * torch.exp(-log_b) + log_b).mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()  # type: ignore[no-untyped-call]
            opt.step()
        model.eval()
        mae = _mae(model, xv, yv)
        history.append(mae)
        if progress is not None:
            progress.set_postfix_str(f"{cfg.label()} epoch {epoch} val MAE {mae:.1f}")
        if mae < best:
            best, best_epoch = mae, epoch
            best_state = copy.deepcopy(model.state_dict())
        elif epoch - best_epoch >= cfg.patience:
            break
    model.load_state_dict(best_state)
    model.eval()
    return TrainResult(cfg, model, best, epoch, best_epoch, time.monotonic() - t0, history)


def search(
    configs: Iterable[TrainConfig], data: dict[str, Samples], progress: bool = True
) -> tuple[TrainResult, list[TrainResult]]:
    """Train every configuration; the best by validation MAE and all results."""
    from tqdm import tqdm

    configs = list(configs)
    if not configs:
        raise ValueError("no configuration to train")
    train, val = data["train"], data["val"]
    if len(train) == 0 or len(val) == 0:
        raise ValueError(f"need rows in train and val splits, got {len(train)} and {len(val)}")
    scale = float(np.mean(train.remaining))
    results = []
    with tqdm(configs, desc="train", unit="cfg", disable=not progress) as bar:
        for cfg in bar:
            results.append(train_one(cfg, train, val, scale, bar))
    best = min(results, key=lambda r: r.val_mae)
    best.model.config = choose_fusion(best.model, val)
    return best, results


DECAYS = (0.0, 0.3, 0.5, 0.7, 0.8, 0.9, 1.0)
POWERS = (0.0, 1.0, 2.0, 3.0, 4.0, 6.0, 8.0)
FIRST_WEIGHTS = (1.0, 2.0, 4.0, 8.0, 16.0, 32.0)


def choose_fusion(model: LengthPredictor, val: Samples) -> PredictorConfig:
    """The config with the fusion (decay, power, first weight) that serves the lowest validation MAE.

    Without the uncertainty output every round weighs the same and the power
    is moot. Ties go to the first in grid order (the simpler fusion).
    """
    from star.predictor.evaluate import fused, mlp_predictions

    pred, sigma = mlp_predictions(model, val)
    true = val.remaining.astype(np.float64)
    powers = POWERS if model.config.uncertainty else (model.config.power,)
    maes = {
        (d, p, f): float(np.mean(np.abs(fused(val, pred, sigma, d, p, f) - true)))
        for d in DECAYS
        for p in powers
        for f in FIRST_WEIGHTS
    }
    decay, power, first = min(maes, key=lambda k: maes[k])
    return dataclasses.replace(model.config, decay=decay, power=power, first_weight=first)


def describe(result: TrainResult) -> dict[str, Any]:
    cfg = asdict(result.config)
    cfg["hidden_sizes"] = list(result.config.hidden_sizes)
    return {
        "config": cfg,
        "val_mae": round(result.val_mae, 3),
        "epochs": result.epochs,
        "best_epoch": result.best_epoch,
        "seconds": round(result.seconds, 1),
        "parameters": result.model.num_parameters(),
    }


def collected_max_tokens(meta: dict[str, Any]) -> int | None:
    """The max_tokens a data directory was collected with (None: not recorded)."""
    value = meta.get("max_tokens")
    return int(value) if value is not None else None


@dataclass
class Trained:
    """What :func:`train_checkpoint` did: the winner, every run, the splits and
    the winner's rows on the test split."""

    best: TrainResult
    results: list[TrainResult]
    splits: dict[str, Samples]
    rows: list[ev.Row]


def train_checkpoint(
    data: DataDir,
    samples: Samples,
    base: TrainConfig,
    out: Path,
    *,
    grid: bool = True,
    seed: int = 0,
    progress: bool = True,
) -> Trained:
    """``star predictor train``: split ``samples`` by prompt (``seed``), train
    ``base`` (with ``grid``, its :func:`default_grid`), evaluate the best on the
    test split and save it to ``out`` with its data, split, search and metrics.

    Raises ValueError when there is nothing to train on.
    """
    splits = split(samples, seed)
    configs = default_grid(base) if grid else [base]
    best, results = search(configs, splits, progress=progress)
    meta = data.index["meta"]
    rows = ev.evaluate(best.model, splits["test"], splits["train"], collected_max_tokens(meta))
    save_checkpoint(
        best.model,
        out,
        {
            "model": meta["model"],
            "hidden_size": int(meta["hidden_size"]),
            "data": {**meta, "hash": data.data_hash(), "rows": len(samples)},
            "split_seed": seed,
            "rows": {k: len(v) for k, v in splits.items()},
            "train": describe(best),
            "search": [describe(r) for r in results],
            "metrics": ev.summary(rows),
        },
    )
    return Trained(best, results, splits, rows)
