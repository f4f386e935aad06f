"""``star model``: the project's tiny demo model (rebuild, measure, check under vLLM)."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

from star.model import tiny_model_path, vllm_check
from star.model.config import TrainConfig


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = sub.add_parser(
        "model",
        help="build and check the tiny demo model",
        description=(
            "The tiny demo model shipped with STAR: a 2-layer Qwen2-architecture model with "
            "its own tokenizer, trained on a synthetic countdown-list task whose answer length "
            "depends on the prompt and on sampling (docs/tiny-model.md)."
        ),
    )
    inner = parser.add_subparsers(dest="model_command", metavar="ACTION", required=True)

    defaults = TrainConfig()
    train = inner.add_parser(
        "train-tiny",
        help="rebuild the tiny model's tokenizer and weights (CPU, ~10 min)",
        description=(
            "Train the tokenizer and the model from scratch on CPU and export them as a "
            "Hugging Face model directory. With the default seed, steps and threads on the "
            "same torch version this reproduces the shipped weights bit for bit; the command "
            "says whether it did."
        ),
    )
    train.add_argument(
        "--out",
        type=Path,
        default=tiny_model_path(),
        metavar="DIR",
        help="output directory (default: the shipped model, %(default)s)",
    )
    train.add_argument(
        "--steps", type=int, default=defaults.steps, help="optimizer steps (default: %(default)s)"
    )
    train.add_argument(
        "--seed", type=int, default=defaults.seed, help="random seed (default: %(default)s)"
    )
    train.add_argument(
        "--threads",
        type=int,
        default=defaults.threads,
        help="torch CPU threads (default: %(default)s; results depend on it)",
    )
    train.add_argument("--quiet", action="store_true", help="no progress bar")
    train.add_argument(
        "--no-check", action="store_true", help="skip the greedy smoke check after training"
    )
    train.set_defaults(func=run)

    vllm = inner.add_parser(
        "check-vllm",
        help="load the model in vLLM, compare with transformers, measure lengths and speed",
        description=(
            "Start vLLM on the model directory (VLLM_CPU_KVCACHE_SPACE defaults to 1 GiB), "
            "check that greedy answers are valid, terminate and equal transformers' (also "
            "through LLM.chat), then print load time, decode throughput and the table of "
            "sampled answer lengths by size."
        ),
    )
    vllm_check.add_arguments(vllm)
    vllm.set_defaults(func=vllm_check.run)


def run(args: argparse.Namespace) -> int:
    """Rebuild the model; exit status 1 when the greedy smoke check fails."""
    from star.model.build import build

    if args.steps < 1 or args.threads < 1:
        print("star: error: --steps and --threads must be at least 1", file=sys.stderr)
        return 2
    cfg = dataclasses.replace(TrainConfig(), steps=args.steps, seed=args.seed, threads=args.threads)
    result = build(args.out, cfg, progress=not args.quiet, check=not args.no_check)
    print(f"wrote {result.out} in {result.seconds:.0f} s; weights sha256 {result.digest[:16]}…")
    if result.reproduced is None:
        print("config differs from the shipped model's: not compared")
    else:
        print(
            "reproduced the shipped weights bit for bit"
            if result.reproduced
            else "weights differ from the shipped ones (another torch build or CPU rounds "
            "differently; the smoke check below says whether the model is as good)"
        )
    failed = 0
    for prompt, tokens, check in result.smoke:
        status = "ok" if check.ok else f"FAILED: {check.errors[0]}"
        print(f"  greedy {prompt.user_text()!r}: {check.items} items, {tokens} tokens, {status}")
        failed += not check.ok
    return 1 if failed else 0
