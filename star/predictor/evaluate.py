"""``star predictor eval``: accuracy on the test split next to baselines (paper §4.3, Table 4).

MAE, NMAE and Kendall's tau per bucket (all rows, by progress, by final
length, and by progress over long answers: the paper's Fig. 7) for
``mlp-fused`` (what the worker serves), ``mlp``, ``constant``,
``prompt-only`` and ``bins:K``, each held to R-hat <= max_tokens - generated
when the data's ``max_tokens`` is known (:func:`clip`). What each predictor
and bucket is: ``docs/predictor.md``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import numpy.typing as npt

from star.planner.trace import BIN_EDGES
from star.predictor.buckets import LENGTH_EDGES, PROGRESS_EDGES, ranges
from star.predictor.dataset import Samples
from star.predictor.model import LengthPredictor

FloatArray = npt.NDArray[np.float64]

LONG = 400
"""Final length (tokens) from which an answer counts as long (the Fig. 7 buckets)."""


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
    for lo, hi, label in ranges(edges):
        mask = values >= lo if hi is None else (values >= lo) & (values < hi)
        out.append((f"{name} {label}", mask))
    return out


def buckets(samples: Samples) -> list[tuple[str, npt.NDArray[np.bool_]]]:
    """(label, row mask): all, by tokens generated, by true final length, long by progress."""
    long = samples.final >= LONG
    return [
        ("all", np.ones(len(samples), dtype=bool)),
        *_buckets(samples.generated, PROGRESS_EDGES, "progress"),
        *_buckets(samples.final, LENGTH_EDGES, "length"),
        *(
            (f"long {label}", mask & long)
            for label, mask in _buckets(samples.generated, PROGRESS_EDGES, "progress")
        ),
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


def mlp_predictions(
    model: LengthPredictor, samples: Samples, batch: int = 4096
) -> tuple[FloatArray, FloatArray]:
    """(R-hat, sigma) in tokens per row (sigma = 1 without the uncertainty output)."""
    import torch

    preds, sigmas = [], []
    for start in range(0, len(samples), batch):
        x = torch.from_numpy(samples.hidden[start : start + batch])
        r, sig = model.predict_with_sigma(x)
        preds.append(r.double().numpy())
        sigmas.append(sig.double().numpy())
    if not preds:
        return np.zeros(0), np.zeros(0)
    return np.concatenate(preds), np.concatenate(sigmas)


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


def fused(
    samples: Samples,
    pred: FloatArray,
    sigma: FloatArray,
    decay: float,
    power: float,
    first_weight: float = 1.0,
) -> FloatArray:
    """What the worker serves: each request's rounds fused in order of progress.

    :func:`star.predictor.model.fuse_step` over a request's rows sorted by
    tokens generated (the worker sees them in that order). ``decay = 0`` gives
    the rows' own predictions.
    """
    from star.predictor.model import fuse_step

    out = np.empty(len(samples))
    state: dict[int, tuple[float, float]] = {}
    for i in np.lexsort((samples.generated, samples.request)).tolist():
        r = int(samples.request[i])
        state[r], out[i] = fuse_step(
            state.get(r),
            float(pred[i]),
            float(sigma[i]),
            int(samples.generated[i]),
            decay,
            power,
            first_weight,
        )
    return out


def clip(pred: FloatArray, samples: Samples, max_tokens: int | None) -> FloatArray:
    """The hard bound: a request cannot run past ``max_tokens``, so R-hat <= max_tokens - generated."""
    if max_tokens is None:
        return pred
    out: FloatArray = np.minimum(pred, float(max_tokens) - samples.generated)
    return out


def predictions(
    model: LengthPredictor, test: Samples, train: Samples, max_tokens: int | None = None
) -> dict[str, FloatArray]:
    """Every predictor's R-hat for every test row (bins quantise the served ``mlp-fused``).

    With ``max_tokens`` every prediction is clipped to the hard bound; the
    served one before clipping is under the key ``unclipped`` (not a column).
    """
    mlp, sigma = mlp_predictions(model, test)
    cfg = model.config
    served = fused(test, mlp, sigma, cfg.decay, cfg.power, cfg.first_weight)
    longest = float(max(train.final.max(initial=1), test.final.max(initial=1)))
    out = {
        "mlp-fused": served,
        "mlp": mlp,
        "constant": np.full(len(test), float(np.mean(train.remaining))),
        "prompt-only": prompt_only(test, mlp),
    }
    for k in (6, 4, 2):
        out[f"bins:{k}"] = quantise(served, bin_edges(k, longest))
    out = {name: clip(p, test, max_tokens) for name, p in out.items()}
    out["unclipped"] = served
    return out


def clip_note(preds: dict[str, FloatArray], test: Samples, max_tokens: int | None) -> str:
    """One line: how the hard bound changed the served predictions."""
    if max_tokens is None:
        return "no hard bound applied (the data does not record max_tokens)"
    served, raw = preds["mlp-fused"], preds["unclipped"]
    moved = int(np.count_nonzero(served != raw))
    true = test.remaining.astype(np.float64)
    return (
        f"hard bound R-hat <= max_tokens - generated (max_tokens {max_tokens}) moved {moved} of "
        f"{len(served)} served predictions; served MAE {np.mean(np.abs(served - true)):.1f} "
        f"clipped, {np.mean(np.abs(raw - true)):.1f} unclipped"
    )


def evaluate(
    model: LengthPredictor,
    test: Samples,
    train: Samples,
    max_tokens: int | None = None,
    preds: dict[str, FloatArray] | None = None,
) -> list[Row]:
    """The whole table: every predictor x every bucket."""
    if preds is None:
        preds = predictions(model, test, train, max_tokens)
    true = test.remaining.astype(np.float64)
    rows = []
    for label, mask in buckets(test):
        for name, pred in preds.items():
            if name == "unclipped":
                continue
            mae, nmae, tau = metrics(pred[mask], true[mask])
            rows.append(Row(name, label, mae, nmae, tau, int(mask.sum())))
    return rows


@dataclass(frozen=True)
class Step:
    """The change of one predictor's MAE from one progress bucket to the next (paper Fig. 7).

    ``low``/``high``: a 95 % bootstrap interval of the change, resampling the
    test split's prompts (the unit the split was drawn in) with every row of
    each; ``verdict``: ``falls`` or ``rises`` when the interval excludes 0,
    else ``flat`` (no change this data can tell from noise).
    """

    family: str
    before: str
    after: str
    change: float
    low: float
    high: float

    @property
    def verdict(self) -> str:
        if self.high < 0:
            return "falls"
        if self.low > 0:
            return "rises"
        return "flat"


def trend(samples: Samples, pred: FloatArray, rounds: int = 1000, seed: int = 0) -> list[Step]:
    """MAE change between consecutive progress buckets, all answers and long ones, with CIs.

    Paired: each bootstrap round draws prompts with replacement and measures
    every bucket on the same draw, so a request's rows stay together.
    """
    err = np.abs(pred - samples.remaining)
    families = [
        ("progress", np.ones(len(samples), dtype=bool)),
        ("long progress", samples.final >= LONG),
    ]
    edges = _buckets(samples.generated, PROGRESS_EDGES, "progress")
    rng = np.random.default_rng(seed)
    steps: list[Step] = []
    for family, sel in families:
        masks = [(label.replace("progress", family, 1), m & sel) for label, m in edges]
        masks = [(label, m) for label, m in masks if m.any()]
        if len(masks) < 2:
            continue
        prompts, inverse = np.unique(samples.prompt[sel], return_inverse=True)
        rows = np.flatnonzero(sel)
        # Per prompt and bucket: error sum and row count; a draw is a weighted sum.
        sums = np.zeros((len(prompts), len(masks)))
        counts = np.zeros((len(prompts), len(masks)))
        for j, (_, m) in enumerate(masks):
            in_bucket = m[rows]
            np.add.at(sums[:, j], inverse[in_bucket], err[rows][in_bucket])
            np.add.at(counts[:, j], inverse[in_bucket], 1.0)
        draws = rng.multinomial(len(prompts), np.full(len(prompts), 1 / len(prompts)), rounds)
        with np.errstate(invalid="ignore", divide="ignore"):
            boot = (draws @ sums) / (draws @ counts)
        point = sums.sum(0) / counts.sum(0)
        last = len(masks) - 1
        # Each step, then the whole way from the first bucket to the last.
        for j, k in [*((j, j + 1) for j in range(last)), (0, last)]:
            diff = boot[:, k] - boot[:, j]
            diff = diff[np.isfinite(diff)]
            low, high = np.percentile(diff, [2.5, 97.5]) if len(diff) else (np.nan, np.nan)
            steps.append(
                Step(
                    family,
                    masks[j][0],
                    masks[k][0],
                    float(point[k] - point[j]),
                    float(low),
                    float(high),
                )
            )
    return steps


def format_trend(steps: Sequence[Step], predictor: str = "mlp-fused") -> str:
    """One line per step: the MAE change, its 95 % interval, falls/flat/rises."""
    lines = [
        f"{predictor} MAE from one progress bucket to the next (95 % bootstrap interval over prompts):"
    ]
    for s in steps:
        after = s.after.split(" ")[-1]
        lines.append(
            f"  {s.before:<22} -> {after:<8} {s.change:+7.1f}  [{s.low:+7.1f}, {s.high:+7.1f}]  {s.verdict}"
        )
    return "\n".join(lines)


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
        f"{'bucket':<22}{'rows':>7}"
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
            f"{label:<22}{first.samples:>7}{cells}{first.nmae:>10.3f}{first.kendall_tau:>9.3f}"
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

    fig, axes = plt.subplots(1, 3, figsize=(16, 4))
    names = list(dict.fromkeys(r.predictor for r in rows))
    xlabels = {
        "progress": "tokens generated (all answers)",
        "length": "true final length",
        "long progress": f"tokens generated (answers of >= {LONG} tokens, cf. Fig. 7)",
    }
    for ax, (prefix, xlabel) in zip(axes, xlabels.items(), strict=True):
        for name in names:
            sel = [
                r
                for r in rows
                if r.predictor == name and r.bucket.startswith(prefix + " ") and r.samples
            ]
            ax.plot(
                [r.bucket.rsplit(" ", 1)[1] for r in sel],
                [r.mae for r in sel],
                marker="o",
                label=name,
            )
        ax.set_xlabel(xlabel)
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
