"""The length predictor's MLP and its checkpoint (paper §4.2, DESIGN §6).

"We employ a lightweight multi-layer perceptron (MLP) ... on the hidden state
of the last token": d -> 2048 -> 512 -> 64 -> 1 with ReLU by default (the
widths are configurable). Inputs are standardised with the training set's
per-feature mean and standard deviation, kept in the module as buffers so a
checkpoint is self-contained. The output is the remaining length in units of
``target_scale`` tokens, or ``log1p`` of it with ``log_target``.

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
    alpha: float = 1.0  # the served R-hat's smoothing over rounds (1 = the last round alone)

    def __post_init__(self) -> None:
        if not 0.0 < self.alpha <= 1.0:
            raise ValueError(f"alpha must be in (0, 1], got {self.alpha}")
        if self.input_dim < 1:
            raise ValueError(f"input_dim must be >= 1, got {self.input_dim}")
        if any(h < 1 for h in self.hidden_sizes):
            raise ValueError(f"hidden sizes must be >= 1, got {self.hidden_sizes}")
        if self.target_scale <= 0:
            raise ValueError(f"target_scale must be > 0, got {self.target_scale}")

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> PredictorConfig:
        return cls(
            input_dim=int(data["input_dim"]),
            hidden_sizes=tuple(int(h) for h in data["hidden_sizes"]),
            log_target=bool(data.get("log_target", False)),
            target_scale=float(data.get("target_scale", 100.0)),
            alpha=float(data.get("alpha", 1.0)),
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
        layers.append(nn.Linear(width, 1))
        self.net = nn.Sequential(*layers)
        self.register_buffer("mean", torch.zeros(config.input_dim))
        self.register_buffer("std", torch.ones(config.input_dim))

    def set_normalisation(self, mean: torch.Tensor, std: torch.Tensor) -> None:
        self.mean.copy_(mean)
        self.std.copy_(torch.clamp(std, min=1e-6))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """The raw output (the training target's encoding), shape (batch,)."""
        out: torch.Tensor = self.net((hidden - self.mean) / self.std).squeeze(-1)
        return out

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

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())


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
