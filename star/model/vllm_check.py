"""Load the tiny model through vLLM's normal model loading, check and measure it.

``python -m star.model.vllm_check [MODEL_DIR]`` (or ``star model
check-vllm``) starts an in-process ``vllm.LLM`` on the model directory, then

* greedy-decodes one prompt per (size, topic) pair through ``LLM.generate``
  (on the chat-templated text) and through ``LLM.chat`` (vLLM applies the
  template), and compares every output token for token with transformers'
  greedy output;
* samples answers (temperature 1, no truncation) for random prompts of each
  size in one batch and prints the length table of ``docs/tiny-model.md``
  together with the load time and the batch's decode throughput.

Exit status 0 when every greedy output is a valid answer that ended with the
end token and equals the reference. vLLM spawns its engine process: run this
as a module or through the CLI, whose entry points are ``__main__``-guarded.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from star.model import task, tiny_model_path

# One prompt per (size, topic) pair over a spread of phrasings and starts.
CHECK_PROMPTS: tuple[task.Prompt, ...] = tuple(
    task.Prompt(
        topic=topic,
        size=size,
        start=None if (i + j) % 5 == 4 else task.TOPICS[topic].words[(3 * i + j) % 12],
        template=(i + j) % len(task.TEMPLATES),
    )
    for i, size in enumerate(task.SIZES)
    for j, topic in enumerate(("animals", "colors", "metals", "trees"))
)


@dataclass(frozen=True, slots=True)
class SizeRow:
    """Measured answer lengths (tokens, end token included) for one size word."""

    size: str
    expected: float  # mean under the task's distribution, over the sampled prompts
    greedy: list[int]
    sampled: list[int]
    valid: float  # fraction of sampled answers passing task.check_answer

    def markdown(self) -> str:
        """One row of :data:`TABLE_HEADER`."""
        s = np.asarray(self.sampled)
        return (
            f"| {self.size} | {self.expected:.0f} | {s.mean():.0f} | {np.median(s):.0f} "
            f"| {np.percentile(s, 90):.0f} | {s.min()}–{s.max()} "
            f"| {min(self.greedy)}–{max(self.greedy)} | {self.valid:.0%} |"
        )


TABLE_HEADER = (
    "| size | task mean | sampled mean | p50 | p90 | range | greedy | valid |\n"
    "|---|---|---|---|---|---|---|---|"
)


@dataclass(frozen=True, slots=True)
class CheckReport:
    """Outcome of :func:`check`."""

    load_s: float
    greedy: list[list[int]]  # per CHECK_PROMPTS entry, via LLM.generate
    chat_equal: int  # prompts where LLM.chat gave the same tokens as LLM.generate
    hf_equal: int | None  # prompts where transformers gave the same tokens (None: skipped)
    valid: int  # greedy answers passing task.check_answer
    finished: int  # greedy answers that ended with the end token
    distinct: int  # distinct greedy texts
    rows: list[SizeRow] = field(default_factory=list)
    requests: int = 0  # sampled requests in the timed batch
    batch_tokens: int = 0
    batch_s: float = 0.0
    single_tokens: int = 0  # one greedy request decoded alone
    single_s: float = 0.0

    @property
    def ok(self) -> bool:
        """Every greedy output terminated, is valid and matched both references."""
        n = len(self.greedy)
        return self.chat_equal == self.valid == self.finished == n and self.hf_equal in (None, n)


def check(
    model_dir: Path,
    prompts_per_size: int = 8,
    samples: int = 4,
    compare_hf: bool = True,
    eager: bool = False,
) -> CheckReport:
    """Run the checks and measurements (starts vLLM in this process: call under ``__main__``)."""
    # vLLM on CPU refuses to start without a KV cache size; 1 GiB holds about
    # 1M tokens of this model, far more than needed here.
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM, SamplingParams

    from star.model.tokenizer import render_chat

    start = time.perf_counter()
    llm = LLM(
        model=str(model_dir),
        dtype="float32",
        max_model_len=4096,
        gpu_memory_utilization=0.3,
        seed=0,
        enforce_eager=eager,
    )
    load_s = time.perf_counter() - start

    greedy_params = SamplingParams(temperature=0.0, max_tokens=2048)
    texts = [render_chat(p.messages()) for p in CHECK_PROMPTS]
    gen = llm.generate(texts, greedy_params, use_tqdm=False)
    conversations: Any = [p.messages() for p in CHECK_PROMPTS]  # OpenAI message dicts
    chat = llm.chat(conversations, greedy_params, use_tqdm=False)
    greedy = [list(o.outputs[0].token_ids) for o in gen]
    chat_equal = sum(list(c.outputs[0].token_ids) == g for c, g in zip(chat, greedy, strict=True))
    finished = sum(o.outputs[0].finish_reason == "stop" for o in gen)
    decoded = [o.outputs[0].text for o in gen]
    valid = sum(task.check_answer(p, t).ok for p, t in zip(CHECK_PROMPTS, decoded, strict=True))

    hf_equal = None
    if compare_hf:
        from star.model.evaluate import generate, load

        model, tok = load(model_dir)
        hf_equal = sum(
            generate(model, tok, prompt, max_new_tokens=2048)[0] == ids
            for prompt, ids in zip(CHECK_PROMPTS, greedy, strict=True)
        )

    # One long greedy request alone: per-request decode speed (TPOT).
    longest = max(range(len(greedy)), key=lambda i: len(greedy[i]))
    t0 = time.perf_counter()
    single = llm.generate([texts[longest]], greedy_params, use_tqdm=False)
    single_s = time.perf_counter() - t0
    single_tokens = len(single[0].outputs[0].token_ids)

    # Sampled lengths by size, all in one batch: also the throughput figure.
    rng = np.random.default_rng(0)
    sampled_prompts = [
        task.sample_prompt(rng, sizes=[size])
        for size in task.SIZES
        for _ in range(prompts_per_size)
    ]
    # No per-request seed: one seed shared by every request draws the same
    # random numbers for all of them (every prompt would get the same count
    # quantile); the engine's own seed keeps the run reproducible.
    params = SamplingParams(temperature=1.0, top_p=1.0, top_k=0, n=samples, max_tokens=2048)
    t0 = time.perf_counter()
    outs = llm.generate(
        [render_chat(p.messages()) for p in sampled_prompts], params, use_tqdm=False
    )
    batch_s = time.perf_counter() - t0
    rows = []
    for size in task.SIZES:
        picked = [(p, o) for p, o in zip(sampled_prompts, outs, strict=True) if p.size == size]
        lengths = [len(c.token_ids) for _, o in picked for c in o.outputs]
        ok = sum(task.check_answer(p, c.text).ok for p, o in picked for c in o.outputs)
        rows.append(
            SizeRow(
                size=size,
                expected=float(np.mean([task.expected_tokens(p) for p, _ in picked])),
                greedy=[
                    len(g) for p, g in zip(CHECK_PROMPTS, greedy, strict=True) if p.size == size
                ],
                sampled=lengths,
                valid=ok / len(lengths),
            )
        )
    return CheckReport(
        load_s=load_s,
        greedy=greedy,
        chat_equal=chat_equal,
        hf_equal=hf_equal,
        valid=valid,
        finished=finished,
        distinct=len(set(decoded)),
        rows=rows,
        requests=len(sampled_prompts) * samples,
        batch_tokens=sum(len(c.token_ids) for o in outs for c in o.outputs),
        batch_s=batch_s,
        single_tokens=single_tokens,
        single_s=single_s,
    )


def print_report(report: CheckReport) -> None:
    """Print the report for an operator (and for docs/tiny-model.md)."""
    n = len(report.greedy)
    print(f"vLLM load (LLM constructor): {report.load_s:.1f} s")
    print(f"greedy: {n} prompts, {report.distinct} distinct outputs")
    print(f"  ended with the end token: {report.finished}/{n}")
    print(f"  valid task answers: {report.valid}/{n}")
    print(f"  LLM.chat == LLM.generate on the templated text: {report.chat_equal}/{n}")
    if report.hf_equal is not None:
        print(f"  equal to transformers' greedy output: {report.hf_equal}/{n}")
    print(
        f"one greedy request alone: {report.single_tokens} tokens in {report.single_s:.2f} s "
        f"= {report.single_tokens / report.single_s:.0f} tokens/s"
    )
    print(
        f"sampled batch of {report.requests} requests: {report.batch_tokens} tokens in "
        f"{report.batch_s:.1f} s = {report.batch_tokens / report.batch_s:.0f} tokens/s"
    )
    print()
    print(TABLE_HEADER)
    for row in report.rows:
        print(row.markdown())
    pooled = np.concatenate([np.asarray(r.sampled) for r in report.rows])
    p50, p90, p99 = np.percentile(pooled, [50, 90, 99])
    print(
        f"\nall sampled: mean {pooled.mean():.0f}, p50 {p50:.0f}, p90 {p90:.0f}, "
        f"p99 {p99:.0f}, max {pooled.max()} tokens"
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry: print the report, exit 0 when all checks pass."""
    parser = argparse.ArgumentParser(
        prog="python -m star.model.vllm_check", description=(__doc__ or "").splitlines()[0]
    )
    add_arguments(parser)
    return run(parser.parse_args(argv))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of this check (shared with ``star model check-vllm``)."""
    parser.add_argument(
        "model", nargs="?", type=Path, default=tiny_model_path(), help="model directory"
    )
    parser.add_argument(
        "--prompts", type=int, default=8, help="sampled prompts per size (default: %(default)s)"
    )
    parser.add_argument(
        "--samples", type=int, default=4, help="samples per prompt (default: %(default)s)"
    )
    parser.add_argument("--no-hf", action="store_true", help="skip the transformers comparison")
    parser.add_argument(
        "--eager",
        action="store_true",
        help="skip torch.compile (enforce_eager): starts in seconds instead of minutes on a small CPU",
    )


def run(args: argparse.Namespace) -> int:
    """Run :func:`check` from parsed arguments and print the report."""
    report = check(
        args.model,
        prompts_per_size=args.prompts,
        samples=args.samples,
        compare_hf=not args.no_hf,
        eager=args.eager,
    )
    print_report(report)
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
