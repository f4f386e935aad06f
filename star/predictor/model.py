"""The length predictor's MLP and its checkpoint (paper §4.2, docs/design.md §6).

"We employ a lightweight multi-layer perceptron (MLP) ... on the hidden state
of the last token": d -> 2048 -> 512 -> 64 -> 1 with ReLU by default (the
widths are configurable). Inputs are standardised with the training set's
per-feature mean and standard deviation, kept in the module as buffers so a
checkpoint is self-contained. The output is the remaining length in units of
``target_scale`` tokens, or ``log1p`` of it with ``log_target``.

With ``uncertainty`` the last layer has a second output, the log of a
Laplace scale b of the first one's error (in the target's encoding) (trained with the Laplace negative
log-likelihood next to the L1 loss, :mod:`star.predictor.train`): how much
this row's hidden state says about the remaining length. The served R-hat
fuses a request's rounds with weights from it (:func:`fuse_step`).

A checkpoint is two files side by side: ``predictor.safetensors`` (weights
and buffers) and ``predictor.json`` (:class:`PredictorConfig` plus metadata:
the model it belongs to, hidden size, data hash, metrics).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

WEIGHTS = "predictor.safetensors"
METADATA = "predictor.json"
FORMAT_VERSION = 1


class CheckpointError(ValueError):
    """A checkpoint is missing, unreadable or does not fit; ``str()`` says which."""


@dataclass(frozen=True)
class PredictorConfig:
    """The MLP's shape and target encoding."""

    input_dim: int
    hidden_sizes: tuple[int, ...] = (2048, 512, 64)
    log_target: bool = False
    target_scale: float = 100.0
    uncertainty: bool = False  # a second output: log Laplace scale of the first's error
    # How the served R-hat fuses a request's rounds (fuse_step): the past's
    # weight decays by ``decay`` per round (0 = the last round alone, the
    # paper's predictor) and a round weighs sigma ** -power (sigma from the
    # uncertainty output; without it every round weighs 1).
    decay: float = 0.0
    power: float = 2.0
    first_weight: float = 1.0  # the first round's (the prompt's) weight is multiplied by this

    def __post_init__(self) -> None:
        if self.first_weight <= 0:
            raise ValueError(f"first_weight must be > 0, got {self.first_weight}")
        if not 0.0 <= self.decay <= 1.0:
            raise ValueError(f"decay must be in [0, 1], got {self.decay}")
        if self.power < 0:
            raise ValueError(f"power must be >= 0, got {self.power}")
        if self.input_dim < 1:
            raise ValueError(f"input_dim must be >= 1, got {self.input_dim}")
        if any(h < 1 for h in self.hidden_sizes):
            raise ValueError(f"hidden sizes must be >= 1, got {self.hidden_sizes}")
        if self.target_scale <= 0:
            raise ValueError(f"target_scale must be > 0, got {self.target_scale}")

    @property
    def outputs(self) -> int:
        return 2 if self.uncertainty else 1

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> PredictorConfig:
        if "decay" in data:
            decay = float(data["decay"])
            power = float(data.get("power", 2.0))
            first_weight = float(data.get("first_weight", 1.0))
        else:
            # Checkpoints from before fusion served an exponential average with
            # weight alpha on the newest round; with equal weights, the past
            # fading by 1 - alpha and the first round at 1 / alpha (its
            # steady-state weight) the fusion is exactly that average.
            alpha = float(data.get("alpha", 1.0))
            if not 0.0 < alpha <= 1.0:
                raise ValueError(f"alpha must be in (0, 1], got {alpha}")
            decay, power, first_weight = 1.0 - alpha, 0.0, 1.0 / alpha
        return cls(
            input_dim=int(data["input_dim"]),
            hidden_sizes=tuple(int(h) for h in data["hidden_sizes"]),
            log_target=bool(data.get("log_target", False)),
            target_scale=float(data.get("target_scale", 100.0)),
            uncertainty=bool(data.get("uncertainty", False)),
            decay=decay,
            power=power,
            first_weight=first_weight,
        )


class LengthPredictor(nn.Module):
    """MLP from a last-layer hidden state to the remaining output length."""

    mean: torch.Tensor  # buffers: the training set's per-feature statistics
    std: torch.Tensor

    def __init__(self, config: PredictorConfig) -> None:
        super().__init__()
        self.config = config
        self.input_dim = config.input_dim
        layers: list[nn.Module] = []
        width = config.input_dim
        for h in config.hidden_sizes:
            layers += [nn.Linear(width, h), nn.ReLU()]
            width = h
        layers.append(nn.Linear(width, config.outputs))
        self.net = nn.Sequential(*layers)
        self.register_buffer("mean", torch.zeros(config.input_dim))
        self.register_buffer("std", torch.ones(config.input_dim))

    def set_normalisation(self, mean: torch.Tensor, std: torch.Tensor) -> None:
        self.mean.copy_(mean)
        self.std.copy_(torch.clamp(std, min=1e-6))

    def forward_all(self, hidden: torch.Tensor) -> torch.Tensor:
        """Every raw output, shape (batch, outputs): the encoded R-hat, then log b."""
        out: torch.Tensor = self.net((hidden - self.mean) / self.std)
        return out

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """The raw R-hat output (the training target's encoding), shape (batch,)."""
        return self.forward_all(hidden)[:, 0]

    def encode(self, remaining: torch.Tensor) -> torch.Tensor:
        """Remaining lengths (tokens) -> the output's encoding."""
        scaled = remaining / self.config.target_scale
        return torch.log1p(scaled) if self.config.log_target else scaled

    def decode(self, raw: torch.Tensor) -> torch.Tensor:
        """The output's encoding -> remaining lengths in tokens (>= 0)."""
        scaled = torch.expm1(raw) if self.config.log_target else raw
        return torch.clamp(scaled * self.config.target_scale, min=0.0)

    @torch.inference_mode()
    def predict(self, hidden: torch.Tensor) -> torch.Tensor:
        """R-hat in tokens for a batch of hidden states (any float dtype/device)."""
        param = self.mean
        return self.decode(self(hidden.to(device=param.device, dtype=param.dtype)))

    @torch.inference_mode()
    def predict_with_sigma(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(R-hat, sigma) in tokens; sigma is 1 for every row without the uncertainty output."""
        param = self.mean
        raw = self.forward_all(hidden.to(device=param.device, dtype=param.dtype))
        r_hat = self.decode(raw[:, 0])
        if not self.config.uncertainty:
            return r_hat, torch.ones_like(r_hat)
        return r_hat, self.sigma(raw[:, 0], raw[:, 1])

    def sigma(self, raw: torch.Tensor, log_b: torch.Tensor) -> torch.Tensor:
        """The error scale in tokens of R-hat = decode(raw), from the scale output log b.

        b is in the target's encoding; in tokens it is b * dR/draw: b * target_scale
        for a linear target, b * (R-hat + target_scale) for the log target.
        """
        b = torch.exp(log_b)
        if self.config.log_target:
            return b * (self.decode(raw) + self.config.target_scale)
        return b * self.config.target_scale

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())


def fuse_step(
    state: tuple[float, float] | None,
    r_hat: float,
    sigma: float,
    generated: int,
    decay: float,
    power: float,
    first_weight: float = 1.0,
) -> tuple[tuple[float, float], float]:
    """One round of the served R-hat: (new state, R-hat to serve).

    A request's final length T = R-hat + generated is a constant, and every
    round is a noisy look at it. The estimate is a weighted mean over the
    rounds so far, a round weighing ``sigma ** -power`` (the first, usually the
    prompt's row, ``first_weight`` times that) and the past fading by
    ``decay`` per round (state: the sums of weights and of weighted T). With
    ``decay = 0`` it is the last round alone; with constant weights it tends
    to an exponential average with weight ``1 - decay`` on the newest round.
    """
    w = max(sigma, 1e-6) ** -power
    if state is None:
        w *= first_weight
        weight, total = w, w * (r_hat + generated)
    else:
        weight = decay * state[0] + w
        total = decay * state[1] + w * (r_hat + generated)
    return (weight, total), max(total / weight - generated, 0.0)


def single_threaded_host_blas() -> bool:
    """Have the BLAS that numpy and scipy ship run on the calling process's thread alone.

    The predictor's products are small (tens of rows): OpenBLAS would split
    them over its threads, which then spin for a while after each call,
    stealing the core the engine's model runs on; single-threaded they take
    tens of microseconds. The compiled MLP (:func:`star.predictor.kernels.mlp`)
    calls scipy's BLAS (numba's ``@`` goes through ``scipy.linalg.cython_blas``),
    numpy's ``@`` numpy's own. A BLAS torch may use for the model is left
    alone (threadpoolctl). Returns whether one was found.
    """
    import scipy.linalg.cython_blas  # noqa: F401 - loads scipy's BLAS so that it is found
    from threadpoolctl import ThreadpoolController

    found = False
    for lib in ThreadpoolController().select(user_api="blas").lib_controllers:
        path = str(lib.filepath)
        if "numpy" in path or "scipy" in path:
            lib.set_num_threads(1)
            found = True
    return found


HOST_MAX_PARAMS = 1_000_000
"""Largest MLP :class:`FastPredictor` runs in its compiled kernel on the host (see ``star bench predictor``)."""


class FastPredictor:
    """The MLP for the engine's hot path: inference only, few calls.

    The input standardisation is folded into the first layer (W' = W / std,
    b' = b - W' mean) and the weights are pre-transposed. On the host a
    small MLP runs in one compiled call (:func:`star.predictor.kernels.mlp`:
    a single-threaded BLAS product per layer, bias and ReLU in place; see
    :func:`single_threaded_host_blas`): torch's OpenMP threads, shared with
    the engine's model, made its few small products 3-40x slower, and one
    numpy call per operation costs several times more right after the
    model's forward pass than in a loop of its own. A large one (the paper's
    8.4 M parameters) and any on a GPU run as one ``addmm`` per layer in torch.
    :meth:`raw_host` gives the raw outputs as a numpy array, which
    :func:`star.predictor.kernels.fuse_round` decodes and fuses;
    :meth:`__call__` gives (R-hat, sigma) in tokens, the same numbers as
    :meth:`LengthPredictor.predict_with_sigma` up to float rounding.
    """

    def __init__(self, model: LengthPredictor, device: str | torch.device | None = None) -> None:
        cfg = model.config
        linears = [m for m in model.net if isinstance(m, nn.Linear)]
        with torch.no_grad():
            first = linears[0]
            w0 = first.weight / model.std[None, :]
            b0 = first.bias - w0 @ model.mean
            params = [(w0, b0)] + [(m.weight, m.bias) for m in linears[1:]]
            dev = device if device is not None else model.mean.device
            self.layers = [
                (w.detach().t().contiguous().to(dev), b.detach().contiguous().to(dev))
                for w, b in params
            ]
        self.dtype = self.layers[0][0].dtype
        size = sum(w.numel() + b.numel() for w, b in self.layers)
        self.host = torch.device(dev).type == "cpu" and size <= HOST_MAX_PARAMS
        self.np_weights = tuple(w.float().numpy() for w, _ in self.layers) if self.host else ()
        self.np_biases = tuple(b.float().numpy() for _, b in self.layers) if self.host else ()
        self.uncertainty = cfg.uncertainty
        self.log_target = cfg.log_target
        self.scale = float(cfg.target_scale)
        self.config = cfg

    def warm(self) -> float:
        """Compile (or load) the kernels for this MLP; returns the seconds it took."""
        from star.predictor import kernels

        # The MLP's signature depends on its depth alone, not on its widths.
        return kernels.warm(depth=len(self.layers))

    def raw_numpy(self, hidden: Any) -> Any:
        """The raw outputs (batch, outputs) of a (batch, d) float32 numpy array (host only)."""
        from star.predictor.kernels import mlp

        return mlp(np.ascontiguousarray(hidden, dtype=np.float32), self.np_weights, self.np_biases)

    def raw(self, hidden: torch.Tensor) -> torch.Tensor:
        """The raw outputs (batch, outputs) of a (batch, d) tensor on the model's device."""
        with torch.inference_mode():
            h = hidden if hidden.dtype == self.dtype else hidden.to(self.dtype)
            last = len(self.layers) - 1
            for i, (wt, b) in enumerate(self.layers):
                h = torch.addmm(b, h, wt)
                if i < last:
                    h.relu_()
            return h

    def raw_host(self, hidden: Any) -> Any:
        """The raw outputs as a float32 numpy array on the host, from a (batch, d) tensor or,
        on the host, a float32 numpy array."""
        if isinstance(hidden, np.ndarray):
            return self.raw_numpy(hidden)
        if self.host:
            h = hidden.detach()
            return self.raw_numpy((h if h.dtype == torch.float32 else h.float()).numpy())
        return np.ascontiguousarray(self.raw(hidden).float().cpu().numpy())

    def __call__(self, hidden: Any) -> tuple[Any, Any]:
        """(R-hat, sigma) in tokens, float32 numpy arrays (sigma = 1 without the scale output).

        ``hidden``: a (batch, d) tensor, or on the host a float32 numpy array.
        """
        raw = self.raw_host(hidden)
        r_hat = raw[:, 0].copy()
        if self.log_target:
            np.expm1(r_hat, out=r_hat)
        r_hat *= self.scale
        np.maximum(r_hat, 0.0, out=r_hat)
        if not self.uncertainty:
            return r_hat, np.ones_like(r_hat)
        sigma = np.exp(raw[:, 1])
        sigma *= (r_hat + self.scale) if self.log_target else self.scale
        return r_hat, sigma


@dataclass
class Checkpoint:
    """A trained predictor and what it was trained for."""

    model: LengthPredictor
    metadata: dict[str, Any] = field(default_factory=dict)

    @property
    def config(self) -> PredictorConfig:
        return self.model.config


def _paths(path: str | Path) -> tuple[Path, Path]:
    p = Path(path)
    if p.suffix == ".safetensors":
        return p, p.with_suffix(".json")
    if p.suffix == ".json":
        return p.with_suffix(".safetensors"), p
    return p / WEIGHTS, p / METADATA


def save_checkpoint(model: LengthPredictor, path: str | Path, metadata: Mapping[str, Any]) -> Path:
    """Write ``predictor.safetensors`` + ``predictor.json`` (``path``: a directory or the weights file)."""
    from safetensors.torch import save_file

    weights, meta = _paths(path)
    weights.parent.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}
    save_file(state, str(weights))
    doc = {
        "format": FORMAT_VERSION,
        "config": {**asdict(model.config), "hidden_sizes": list(model.config.hidden_sizes)},
        **dict(metadata),
    }
    meta.write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n")
    return weights


def load_checkpoint(path: str | Path, device: str = "cpu") -> Checkpoint:
    """Load a checkpoint written by :func:`save_checkpoint` (raises :class:`CheckpointError`)."""
    from safetensors.torch import load_file

    weights, meta = _paths(path)
    if not weights.is_file() or not meta.is_file():
        raise CheckpointError(
            f"no predictor checkpoint at {path} (need {weights.name} and {meta.name})"
        )
    try:
        doc = json.loads(meta.read_text())
        if doc.get("format") != FORMAT_VERSION:
            raise CheckpointError(f"{meta}: unknown format {doc.get('format')!r}")
        model = LengthPredictor(PredictorConfig.from_dict(doc["config"]))
        model.load_state_dict(load_file(str(weights), device=device))
    except (KeyError, TypeError, ValueError, RuntimeError, json.JSONDecodeError) as exc:
        if isinstance(exc, CheckpointError):
            raise
        raise CheckpointError(f"bad predictor checkpoint at {path}: {exc}") from None
    model.to(device).eval()
    metadata = {k: v for k, v in doc.items() if k not in ("format", "config")}
    return Checkpoint(model, metadata)


def default_checkpoint(model_path: str | Path) -> Path | None:
    """The checkpoint shipped next to a model (``MODEL/predictor/``), if there is one."""
    candidate = Path(model_path) / "predictor"
    if (candidate / WEIGHTS).is_file() and (candidate / METADATA).is_file():
        return candidate
    return None


def build_mlp(input_dim: int, hidden_sizes: Sequence[int], **kw: Any) -> LengthPredictor:
    """A fresh predictor (random init) of the given shape."""
    return LengthPredictor(PredictorConfig(input_dim, tuple(hidden_sizes), **kw))
