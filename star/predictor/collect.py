"""The data side of ``star predictor collect`` (paper §4.2): prompts in, rows out.

The engine run is :mod:`workers.collect`: requests go through a decode
engine with the hidden-state tap in collection mode, in rounds of ``batch``
concurrent requests, and after each round :func:`rows_of` joins the tap's
rows with the final lengths into one shard (:mod:`star.predictor.dataset`).

Workloads: ``synthetic`` draws prompts of the tiny model's countdown-list task
(:mod:`star.model.task`, rendered with its chat template); a file is JSON
lines, each ``{"prompt_token_ids": [...]}``, ``{"prompt": "text"}`` or
``{"messages": [...]}`` (rendered with the model's chat template). Each prompt
is sampled ``samples_per_prompt`` times: request r has prompt r // samples.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from star.predictor.dataset import DataDir, Samples

SAMPLING = {"temperature": 1.0, "top_p": 1.0, "top_k": 0}


def synthetic_prompt_ids(model: str, seed: int) -> Callable[[int], list[int]]:
    """Prompt p of the tiny model's task (deterministic in ``seed`` and ``p``)."""
    from tokenizers import Tokenizer

    from star.model import task
    from star.model.tokenizer import render_chat

    tok = Tokenizer.from_file(str(Path(model) / "tokenizer.json"))

    def prompt(p: int) -> list[int]:
        rng = np.random.default_rng([seed, p])
        return list(tok.encode(render_chat(task.sample_prompt(rng).messages())).ids)

    return prompt


def file_prompt_ids(model: str, path: Path) -> tuple[Callable[[int], list[int]], int]:
    """Prompts of a JSON-lines workload file, and how many there are."""
    lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if not lines:
        raise ValueError(f"{path}: no prompts")
    tokenizer: Any = None

    def prompt(p: int) -> list[int]:
        nonlocal tokenizer
        item = lines[p % len(lines)]
        if "prompt_token_ids" in item:
            return [int(t) for t in item["prompt_token_ids"]]
        if tokenizer is None:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(model)
        if "messages" in item:
            return list(
                tokenizer.apply_chat_template(
                    item["messages"], add_generation_prompt=True, tokenize=True
                )
            )
        if "prompt" in item:
            return list(tokenizer(item["prompt"])["input_ids"])
        raise ValueError(
            f"{path}: line {p % len(lines) + 1} has no prompt_token_ids, prompt or messages"
        )

    return prompt, len(lines)


def rows_of(
    drained: dict[str, Any],
    finals: dict[str, tuple[int, bool]],
    numbers: dict[str, tuple[int, int]],
) -> Samples:
    """Join the tap's rows with the finished requests' lengths."""
    dim = int(drained["dim"]) or 1
    hidden = (
        np.frombuffer(drained["hidden"], dtype=np.float32).reshape(-1, dim)
        if drained["ids"]
        else np.zeros((0, dim), np.float32)
    )
    keep = [i for i, rid in enumerate(drained["ids"]) if rid in finals]
    ids = [drained["ids"][i] for i in keep]
    gen = np.array([drained["generated"][i] for i in keep], dtype=np.int64)
    final = np.array([finals[r][0] for r in ids], dtype=np.int64)
    ok = gen < final  # the row that sampled the last token has one left to go
    return Samples(
        hidden=hidden[keep][ok].copy(),
        generated=gen[ok],
        remaining=(final - gen)[ok],
        final=final[ok],
        request=np.array([numbers[r][0] for r in ids], dtype=np.int64)[ok],
        prompt=np.array([numbers[r][1] for r in ids], dtype=np.int64)[ok],
        capped=np.array([finals[r][1] for r in ids], dtype=bool)[ok],
    )


def stats_line(data: DataDir) -> str:
    reqs: Sequence[dict[str, Any]] = [q for s in data.index["shards"] for q in s["requests"]]
    finals = [q["final"] for q in reqs]
    return (
        f"{data.root}: {len(reqs)} requests, {data.rows} rows, hidden size {data.index['meta']['hidden_size']}; "
        f"final length mean {np.mean(finals):.0f}, p50 {np.median(finals):.0f}, max {max(finals)}"
        if finals
        else f"{data.root}: empty"
    )
