"""``star predictor collect``: hidden states and remaining lengths from a real engine (paper §4.2).

Requests run through the worker's engine (:class:`workers.engine.EngineHandle`,
vLLM ``AsyncLLM`` in process) with the hidden-state tap in collection mode.
They are submitted in rounds of ``batch`` concurrent requests; after each
round the tap's rows are joined with the final lengths and written as one
shard (:mod:`star.predictor.dataset`), so an interrupted run resumes at the
round it lost.

Workloads: ``synthetic`` draws prompts of the tiny model's countdown-list task
(:mod:`star.model.task`, rendered with its chat template); a file is JSON
lines, each ``{"prompt_token_ids": [...]}``, ``{"prompt": "text"}`` or
``{"messages": [...]}`` (rendered with the model's chat template). Each prompt
is sampled ``samples_per_prompt`` times: request r has prompt r // samples.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import structlog

from star.predictor.dataset import DataDir, Samples

log = structlog.get_logger(__name__)

SAMPLING = {"temperature": 1.0, "top_p": 1.0, "top_k": 0}


@dataclass(frozen=True)
class CollectConfig:
    model: str
    out: Path
    workload: str = "synthetic"
    requests: int = 400
    samples_per_prompt: int = 2
    batch: int = 64
    every: int = 20
    seed: int = 0
    max_tokens: int = 2048
    max_model_len: int = 4096
    kv_cache_space_gib: float = 0.5


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


async def _run_one(
    engine: Any, rid: str, prompt: list[int], max_tokens: int
) -> tuple[str, int, bool]:
    from workers.protocol import GenerateRequest

    request = GenerateRequest(rid, prompt, {**SAMPLING, "max_tokens": max_tokens})
    generated = 0
    reason = None
    async for delta in engine.generate(request):
        generated += len(delta.token_ids)
        reason = delta.finish_reason or reason
    return rid, generated, reason == "length"


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


async def collect(cfg: CollectConfig, progress: bool = True, engine: Any = None) -> DataDir:
    """Run the collection; returns the data directory.

    Without ``engine`` it starts one (in this process: call under
    ``__main__``) and stops it at the end; a given decode
    :class:`~workers.engine.EngineHandle` is used as is (its tap is switched
    to collection mode) and left running.
    """
    from tqdm import tqdm

    from workers.engine import EngineHandle, EngineSpec

    if cfg.workload == "synthetic":
        prompt_of = synthetic_prompt_ids(cfg.model, cfg.seed)
        workload_id = "synthetic"
    else:
        path = Path(cfg.workload)
        prompt_of, _ = file_prompt_ids(cfg.model, path)
        workload_id = f"file:{path.name}"
    data = DataDir(cfg.out)
    spec = EngineSpec(
        model=cfg.model,
        role="decode",
        max_model_len=cfg.max_model_len,
        kv_cache_space_gib=cfg.kv_cache_space_gib,
        engine_args={"seed": cfg.seed},
    )
    own = engine is None
    if own:
        engine = await EngineHandle.start(spec)
    try:
        hidden_size = await engine.install_tap(cfg.every, collect=True)
        data.start(
            {
                "model": Path(cfg.model).name,
                "hidden_size": hidden_size,
                "workload": workload_id,
                "seed": cfg.seed,
                "every": cfg.every,
                "samples_per_prompt": cfg.samples_per_prompt,
                "max_tokens": cfg.max_tokens,
                "sampling": SAMPLING,
            }
        )
        start = data.next_request
        bar = tqdm(
            total=cfg.requests,
            initial=min(start, cfg.requests),
            unit="req",
            disable=not progress,
            desc="collect",
        )
        t0 = time.monotonic()
        r = start
        while r < cfg.requests:
            end = min(r + cfg.batch, cfg.requests)
            numbers = {f"c{n}": (n, n // cfg.samples_per_prompt) for n in range(r, end)}
            jobs = [
                _run_one(engine, rid, prompt_of(p), cfg.max_tokens)
                for rid, (_, p) in numbers.items()
            ]
            finals: dict[str, tuple[int, bool]] = {}
            for fut in asyncio.as_completed(jobs):
                rid, length, capped = await fut
                finals[rid] = (length, capped)
                bar.update(1)
            samples = rows_of(await engine.tap.drain(), finals, numbers)
            data.append(
                samples,
                end,
                [
                    {"n": numbers[rid][0], "prompt": numbers[rid][1], "final": f, "capped": c}
                    for rid, (f, c) in sorted(finals.items(), key=lambda kv: numbers[kv[0]][0])
                ],
            )
            r = end
        bar.close()
        log.info(
            "collected",
            requests=cfg.requests - start,
            rows=data.rows,
            seconds=round(time.monotonic() - t0, 1),
        )
    finally:
        if own:
            await engine.shutdown()
    return data


def stats_line(data: DataDir) -> str:
    reqs: Sequence[dict[str, Any]] = [q for s in data.index["shards"] for q in s["requests"]]
    finals = [q["final"] for q in reqs]
    return (
        f"{data.root}: {len(reqs)} requests, {data.rows} rows, hidden size {data.index['meta']['hidden_size']}; "
        f"final length mean {np.mean(finals):.0f}, p50 {np.median(finals):.0f}, max {max(finals)}"
        if finals
        else f"{data.root}: empty"
    )
