"""``star predictor collect``: hidden states and remaining lengths from a real engine (paper §4.2).

Requests run through the worker's engine (:class:`workers.engine.EngineHandle`,
vLLM ``AsyncLLM`` in process) with the hidden-state tap in collection mode.
They are submitted in rounds of ``batch`` concurrent requests; after each
round the tap's rows are joined with the final lengths and written as one
shard (:mod:`star.predictor.collect` has the prompts and the rows,
:mod:`star.predictor.dataset` the format), so an interrupted run resumes at
the round it lost.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog

from star.predictor.collect import SAMPLING, file_prompt_ids, rows_of, synthetic_prompt_ids
from star.predictor.dataset import DataDir
from workers.protocol import GenerateRequest

log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class CollectConfig:
    """One collection run: the model, the data directory ``out``, the workload and the engine."""

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


async def run_one(
    engine: Any, rid: str, prompt: list[int], max_tokens: int
) -> tuple[str, int, bool]:
    """Generate one request to the end: its id, tokens generated, whether max_tokens capped it."""
    request = GenerateRequest(rid, prompt, {**SAMPLING, "max_tokens": max_tokens})
    generated = 0
    reason = None
    async for delta in engine.generate(request):
        generated += len(delta.token_ids)
        reason = delta.finish_reason or reason
    return rid, generated, reason == "length"


async def collect(cfg: CollectConfig, progress: bool = True, engine: Any = None) -> DataDir:
    """Run the collection; returns the data directory.

    Without ``engine`` it starts one (in this process: call under
    ``__main__``) and stops it at the end; a given decode
    :class:`~workers.engine.EngineHandle` is used as is (its tap is switched
    to collection mode) and left running.
    """
    from tqdm import tqdm

    from workers.engine import EngineHandle
    from workers.engine_config import EngineSpec

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
                run_one(engine, rid, prompt_of(p), cfg.max_tokens)
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
