"""Rebuild the tiny model end to end: tokenizer, training, export, a greedy check.

``star model train-tiny`` runs :func:`build`. The build records what
determined the weights in ``star_build.json`` next to them (training config,
library versions, the weights' SHA-256), so a rebuild can say whether it
reproduced the shipped model bit for bit: it does with the same seed, steps,
thread count, torch version and CPU family (float rounding differs across
those, and the result is then an equally good but different model).
"""

from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import tokenizers
import torch
import transformers

from star.model import task, tiny_model_path
from star.model.config import TrainConfig
from star.model.export import export, weights_digest
from star.model.tokenizer import train_tokenizer
from star.model.train import train

BUILD_INFO = "star_build.json"

# Prompts of the post-build smoke check: one per size, varied topics.
SMOKE_PROMPTS: tuple[task.Prompt, ...] = (
    task.Prompt(topic="animals", size="tiny", start="owl"),
    task.Prompt(topic="fruits", size="short", start="plum", template=1),
    task.Prompt(topic="colors", size="medium", template=2),
    task.Prompt(topic="metals", size="long", start="tin", template=3),
    task.Prompt(topic="trees", size="huge", start="elm"),
)


@dataclass(frozen=True, slots=True)
class BuildResult:
    """What a build produced and how it checked out."""

    out: Path
    digest: str
    seconds: float
    reproduced: bool | None  # None: the shipped model was built with another config
    smoke: tuple[tuple[task.Prompt, int, task.Check], ...]  # prompt, tokens, check


def build_info(cfg: TrainConfig, digest: str) -> dict[str, Any]:
    """The record written to ``star_build.json``."""
    return {
        "config": dataclasses.asdict(cfg),
        "versions": {
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "tokenizers": tokenizers.__version__,
        },
        "weights_sha256": digest,
    }


def read_build_info(model_dir: Path) -> dict[str, Any] | None:
    """The build record of a model directory, or None when it has none."""
    path = model_dir / BUILD_INFO
    if not path.exists():
        return None
    info: dict[str, Any] = json.loads(path.read_text())
    return info


def build(out: Path, cfg: TrainConfig, progress: bool = True, check: bool = True) -> BuildResult:
    """Train and export the tiny model into ``out``, then greedy-check it with transformers."""
    # Read the shipped record first: ``out`` may be the shipped directory.
    shipped = read_build_info(tiny_model_path())
    start = time.perf_counter()
    tok = train_tokenizer(seed=cfg.seed)
    model = train(cfg, tok, progress=progress)
    export(model, tok, out)
    digest = weights_digest(out)
    info = build_info(cfg, digest)
    (out / BUILD_INFO).write_text(json.dumps(info, indent=2, sort_keys=True) + "\n")
    seconds = time.perf_counter() - start

    reproduced = None
    if shipped is not None and shipped["config"] == info["config"]:
        reproduced = shipped["weights_sha256"] == digest

    if not check:
        return BuildResult(out, digest, seconds, reproduced, ())

    from star.model.evaluate import decode, generate, load  # loads the exported files

    reloaded, hf_tok = load(out)
    smoke = []
    for prompt in SMOKE_PROMPTS:
        ids = generate(reloaded, hf_tok, prompt, max_new_tokens=2048)[0]
        text = decode(hf_tok, ids)
        smoke.append((prompt, len(ids), task.check_answer(prompt, text)))
    return BuildResult(out, digest, seconds, reproduced, tuple(smoke))
