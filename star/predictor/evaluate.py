"""``star predictor eval``: accuracy on the test split next to baselines (paper §4.3, Table 4).

Metrics per bucket: MAE (tokens), NMAE (MAE / mean true remaining length in
the bucket) and Kendall's tau between predicted and true remaining lengths.
Buckets: all rows; by progress (tokens already generated: the paper's Fig. 7
shows the MAE falling as generation proceeds); by the request's true final
length.

Predictors in the same table:

* ``mlp-ema``: what the worker serves (``workers/tap.py``): the MLP's
  predicted final length (R-hat + tokens generated) averaged exponentially
  over the request's rounds so far (weight ``alpha`` on the newest, chosen on
  the validation split by training), minus the tokens generated now.
* ``mlp``: the trained MLP on each row alone (the paper's predictor).
* ``constant``: the training set's mean remaining length, for every row.
* ``prompt-only``: the MLP's prediction at progress 0 (the last prompt token)
  kept for the whole request, aged by the tokens generated since
  (R-hat(g) = max(R-hat(0) - g, 1)): what a predictor that only sees the
  prompt can know.
* ``bins:K`` (K = 2, 4, 6): the MLP's prediction quantised to the midpoint of
  its bin, with the paper's Table 4 edges (fractions of its 32K range) scaled
  to this data's longest answer (:func:`bin_edges`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import numpy.typing as npt

from star.planner.trace import BIN_EDGES
from star.predictor.dataset import Samples
from star.predictor.model import LengthPredictor

FloatArray = npt.NDArray[np.float64]

PROGRESS_EDGES = (0, 1, 50, 100, 200, 400)
LENGTH_EDGES = (0, 50, 100, 200, 400, 800)


@dataclass(frozen=True)
class Row:
    """One line of the evaluation table (``--json`` rows)."""

    predictor: str
    bucket: str
    mae: float
    nmae: float
    kendall_tau: float
    samples: int


def kendall_tau(pred: FloatArray, true: FloatArray, chunk: int = 1024) -> float:
    """Kendall's tau-b (NaN when undefined: fewer than two rows or a constant side).

    Counts concordant and discordant pairs directly, in row chunks: O(n^2)
    time, O(chunk * n) memory; a test split has a few thousand rows.
    """
    x = np.asarray(pred, dtype=np.float64)
    y = np.asarray(true, dtype=np.float64)
    n = len(x)
    if n < 2 or np.all(x == x[0]) or np.all(y == y[0]):
        return float("nan")
    s = 0.0  # sum of sign products: concordant - discordant
    tx = 0.0  # pairs not tied in x
    ty = 0.0  # pairs not tied in y
    for start in range(0, n, chunk):
        dx = np.sign(x[start : start + chunk, None] - x[None, :])
        dy = np.sign(y[start : start + chunk, None] - y[None, :])
        s += float((dx * dy).sum())
        tx += float(np.count_nonzero(dx))
        ty += float(np.count_nonzero(dy))
    return s / float(np.sqrt(tx * ty))


def metrics(pred: FloatArray, true: FloatArray) -> tuple[float, float, float]:
    """(MAE, NMAE, Kendall tau) of predictions against true remaining lengths."""
    if len(true) == 0:
        return float("nan"), float("nan"), float("nan")
    mae = float(np.mean(np.abs(pred - true)))
    return mae, mae / float(np.mean(true)), kendall_tau(pred, true)


def _buckets(
    values: npt.NDArray[np.int64], edges: Sequence[int], name: str
) -> list[tuple[str, npt.NDArray[np.bool_]]]:
    out = []
    for lo, hi in zip(edges, [*edges[1:], None], strict=True):
        if hi is None:
            label = f"{name} {lo}+"
            mask = values >= lo
        elif hi == lo + 1:
            label = f"{name} {lo}"
            mask = values == lo
        else:
            label = f"{name} {lo}-{hi - 1}"
            mask = (values >= lo) & (values < hi)
        out.append((label, mask))
    return out


def buckets(samples: Samples) -> list[tuple[str, npt.NDArray[np.bool_]]]:
    """(label, row mask): all, by tokens generated, by true final length."""
    return [
        ("all", np.ones(len(samples), dtype=bool)),
        *_buckets(samples.generated, PROGRESS_EDGES, "progress"),
        *_buckets(samples.final, LENGTH_EDGES, "length"),
    ]


def bin_edges(bins: int, longest: float) -> FloatArray:
    """The paper's Table 4 bin edges for ``bins`` bins, scaled from 32K to ``longest`` tokens."""
    edges = np.asarray(BIN_EDGES[bins], dtype=np.float64)
    out: FloatArray = edges / edges[-1] * longest
    return out


def quantise(pred: FloatArray, edges: FloatArray) -> FloatArray:
    """Each prediction replaced by the midpoint of its bin (top bin for everything past it)."""
    mids = (edges[:-1] + edges[1:]) / 2.0
    idx = np.searchsorted(edges[1:-1], pred, side="right")
    out: FloatArray = mids[idx]
    return out


def mlp_predictions(model: LengthPredictor, samples: Samples, batch: int = 4096) -> FloatArray:
    import torch

    out = []
    for start in range(0, len(samples), batch):
        x = torch.from_numpy(samples.hidden[start : start + batch])
        out.append(model.predict(x).double().numpy())
    return np.concatenate(out) if out else np.zeros(0)


def prompt_only(samples: Samples, pred: FloatArray) -> FloatArray:
    """R-hat(0) of each row's request, aged by the tokens generated since (NaN-free).

    A request without a progress-0 row uses its earliest row, aged from there.
    """
    out = np.empty(len(samples))
    order = np.lexsort((samples.generated, samples.request))
    first_of: dict[int, tuple[float, int]] = {}
    for i in order.tolist():
        r = int(samples.request[i])
        if r not in first_of:
            first_of[r] = (float(pred[i]), int(samples.generated[i]))
    for i in range(len(samples)):
        p0, g0 = first_of[int(samples.request[i])]
        out[i] = max(p0 - (int(samples.generated[i]) - g0), 1.0)
    return out


def smoothed(samples: Samples, pred: FloatArray, alpha: float) -> FloatArray:
    """What the worker serves: an exponential average of the predicted final length.

    Over a request's rows in order of progress, T = R-hat + generated is
    averaged with weight ``alpha`` on the newest row; the served R-hat is
    T - generated (at least 0). ``alpha = 1`` gives the rows' own predictions.
    """
    out = np.empty(len(samples))
    totals: dict[int, float] = {}
    for i in np.lexsort((samples.generated, samples.request)).tolist():
        r, g = int(samples.request[i]), float(samples.generated[i])
        prev = totals.get(r)
        total = pred[i] + g if prev is None else (1 - alpha) * prev + alpha * (pred[i] + g)
        totals[r] = total
        out[i] = max(total - g, 0.0)
    return out


def predictions(model: LengthPredictor, test: Samples, train: Samples) -> dict[str, FloatArray]:
    """Every predictor's R-hat for every test row (bins quantise the served ``mlp-ema``)."""
    mlp = mlp_predictions(model, test)
    served = smoothed(test, mlp, model.config.alpha)
    longest = float(max(train.final.max(initial=1), test.final.max(initial=1)))
    out = {
        "mlp-ema": served,
        "mlp": mlp,
        "constant": np.full(len(test), float(np.mean(train.remaining))),
        "prompt-only": prompt_only(test, mlp),
    }
    for k in (6, 4, 2):
        out[f"bins:{k}"] = quantise(served, bin_edges(k, longest))
    return out


def evaluate(model: LengthPredictor, test: Samples, train: Samples) -> list[Row]:
    """The whole table: every predictor x every bucket."""
    preds = predictions(model, test, train)
    true = test.remaining.astype(np.float64)
    rows = []
    for label, mask in buckets(test):
        for name, pred in preds.items():
            mae, nmae, tau = metrics(pred[mask], true[mask])
            rows.append(Row(name, label, mae, nmae, tau, int(mask.sum())))
    return rows


def summary(rows: Sequence[Row]) -> dict[str, dict[str, float]]:
    """{predictor: {mae, nmae, kendall_tau}} over all test rows (checkpoint metadata)."""
    return {
        r.predictor: {
            "mae": round(r.mae, 2),
            "nmae": round(r.nmae, 4),
            "kendall_tau": round(r.kendall_tau, 4),
        }
        for r in rows
        if r.bucket == "all"
    }


def format_table(rows: Sequence[Row]) -> str:
    """Buckets down, predictors across: MAE; NMAE and tau of the first predictor (served)."""
    names = list(dict.fromkeys(r.predictor for r in rows))
    labels = list(dict.fromkeys(r.bucket for r in rows))
    at = {(r.predictor, r.bucket): r for r in rows}
    head = (
        f"{'bucket':<16}{'rows':>7}"
        + "".join(f"{n:>12}" for n in names)
        + f"{'nmae':>10}{'tau':>9}"
    )
    lines = [head, "-" * len(head)]
    for label in labels:
        first = at[(names[0], label)]
        if first.samples == 0:
            continue
        cells = "".join(f"{at[(n, label)].mae:>12.1f}" for n in names)
        lines.append(
            f"{label:<16}{first.samples:>7}{cells}{first.nmae:>10.3f}{first.kendall_tau:>9.3f}"
        )
    return "\n".join(lines)


def as_dicts(rows: Sequence[Row]) -> list[dict[str, object]]:
    def clean(v: object) -> object:
        return None if isinstance(v, float) and np.isnan(v) else v

    return [{k: clean(v) for k, v in asdict(r).items()} for r in rows]


def plot(rows: Sequence[Row], out: Path, title: str = "") -> Path:
    """MAE by progress bucket and by true-length bucket, one line per predictor."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    names = list(dict.fromkeys(r.predictor for r in rows))
    for ax, prefix in zip(axes, ("progress", "length"), strict=True):
        for name in names:
            sel = [
                r for r in rows if r.predictor == name and r.bucket.startswith(prefix) and r.samples
            ]
            ax.plot(
                [r.bucket.split(" ", 1)[1] for r in sel],
                [r.mae for r in sel],
                marker="o",
                label=name,
            )
        ax.set_xlabel("tokens generated" if prefix == "progress" else "true final length")
        ax.set_ylabel("MAE (tokens)")
        ax.grid(alpha=0.3)
    axes[0].legend()
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
