"""The training configuration of the tiny model (kept free of torch imports for the CLI)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class TrainConfig:
    """Everything that determines the trained weights (with torch's version and CPU)."""

    steps: int = 800
    seed: int = 0
    batch_tokens: int = 8192  # tokens per optimizer step, padding included
    lr: float = 3e-3
    min_lr_ratio: float = 0.05
    warmup_steps: int = 100
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    head_only_fraction: float = 0.5  # examples cut after head_items items
    head_items: int = 3
    plan_weight: float = 20.0  # loss weight of the first answer token (the item count)
    pool: int = 512  # examples sorted by length together when forming batches
    # One thread: on a shared 2-core machine, two OpenMP threads contending
    # with another process run 2-3x slower than one; one thread also keeps
    # the floating-point reduction order, hence the weights, machine-independent.
    threads: int = 1
    bf16: bool = True  # autocast matmuls to bfloat16 (weights and optimizer stay float32)
    # Model shape.
    hidden_size: int = 128
    intermediate_size: int = 512
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    max_position_embeddings: int = 4096
