"""``star bench predictor``: length-predictor MLP latency (paper §5.3, docs/design.md §7).

The paper's predictor for Qwen2.5-7B (d = 3584, d -> 2048 -> 512 -> 64 -> 1,
8.4 M parameters) takes 1.33 ms at batch 1 and 2.4 ms at batch 10 on its
GPU. This times the same MLP (random weights: latency does not depend on
them) at batch 1, 10 and 64 for d = 3584 and for the tiny demo model's
hidden size (128), on CPU with the given thread count and, when
``torch.cuda`` is available, on the GPU (synchronised, after warm-up).

Run as ``star bench predictor`` or ``python -m benchmarks.predictor``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.common import bench_main, text_table

PAPER_DIM = 3584
TINY_DIM = 128
BATCHES = (1, 10, 64)


def time_mlp(
    dim: int,
    batch: int,
    device: str,
    repeats: int,
    hidden: Sequence[int],
    outputs: int = 1,
) -> dict[str, Any]:
    """Median and p90 latency (ms) of one prediction at ``batch``.

    Two paths: the ``nn.Module`` (``LengthPredictor.predict``: standardise,
    forward, decode) and the engine's (``FastPredictor``: normalisation folded
    into the first layer, one product per layer -- in numpy with single-threaded
    BLAS on the CPU, as in the engine -- decoding in numpy, R-hat and sigma back
    on the CPU).
    """
    import torch

    from star.predictor.model import FastPredictor, build_mlp, single_threaded_host_blas

    model = build_mlp(dim, hidden, uncertainty=outputs == 2, log_target=True).to(device).eval()
    fast = FastPredictor(model)
    if fast.host:
        single_threaded_host_blas()
    x = torch.randn(batch, dim, device=device)

    def sync() -> None:
        if device == "cuda":
            torch.cuda.synchronize()

    def timed(fn: Any) -> list[float]:
        for _ in range(max(3, repeats // 10)):
            fn(x)
        sync()
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn(x)
            sync()
            times.append((time.perf_counter() - t0) * 1e3)
        times.sort()
        return times

    module = timed(model.predict)
    engine = timed(fast)
    return {
        "device": device,
        "dim": dim,
        "batch": batch,
        "params": model.num_parameters(),
        "hidden": list(hidden),
        "outputs": outputs,
        "median_ms": statistics.median(module),
        "p90_ms": module[int(0.9 * (len(module) - 1))],
        "engine_median_ms": statistics.median(engine),
    }


async def engine_overhead(
    model: str, checkpoint: str, requests: int, every: int, seed: int = 0
) -> dict[str, Any]:
    """Predictor time per prediction round vs model step time, in a real engine.

    Runs ``requests`` sampled task prompts at once through a decode engine with
    the tap predicting every ``every`` steps (and once per request when its
    prompt completes). Everything is timed inside the engine's worker, in one
    process: the tap's time (rounds: row selection, MLP, fusion; other steps:
    the prompt-completion check, done only after a step schedules a new
    request) over the time of the model steps that contain it
    (``execute_model`` + ``sample_tokens``), in wall-clock and in thread CPU
    time -- the latter not inflated by other work on a shared machine.
    Target <= 0.5 % at k = 20; the paper: 0.38 %.
    """
    import asyncio

    from star.predictor.collect import synthetic_prompt_ids
    from workers.collect import run_one
    from workers.engine import EngineHandle
    from workers.engine_config import EngineSpec

    engine = await EngineHandle.start(
        EngineSpec(model=model, kv_cache_space_gib=0.5, engine_args={"seed": seed})
    )
    try:
        # engine.install_tap has no profile switch: ask the tap client directly.
        await engine.tap.install(every, checkpoint, profile=True)
        prompt_of = synthetic_prompt_ids(model, seed + 1)
        await engine.predictions()
        before = engine.tap.timing
        await asyncio.gather(
            *(run_one(engine, f"b{i}", prompt_of(i), 2048) for i in range(requests))
        )
        await engine.predictions()  # refreshes engine.tap.timing
        after = engine.tap.timing
    finally:
        await engine.shutdown()
    steps = after.steps - before.steps
    rounds = after.batches - before.batches
    predict_s = after.predict_s - before.predict_s
    check_s = after.check_s - before.check_s
    step_s = after.step_s - before.step_s
    tap_cpu_s = after.tap_cpu_s - before.tap_cpu_s
    step_cpu_s = after.step_cpu_s - before.step_cpu_s
    return {
        "requests": requests,
        "every": every,
        "steps": steps,
        "mean_step_ms": step_s / max(steps, 1) * 1e3,
        "rounds": rounds,
        "mean_rows": (after.rows - before.rows) / max(rounds, 1),
        "mean_round_ms": predict_s / max(rounds, 1) * 1e3,
        "predict_s": predict_s,
        "check_s": check_s,
        "mean_check_us": check_s / max(steps - rounds, 1) * 1e6,
        "step_s": step_s,
        "overhead_pct": 100 * (predict_s + check_s) / step_s if step_s else float("nan"),
        "rounds_pct": 100 * predict_s / step_s if step_s else float("nan"),
        "tap_cpu_s": tap_cpu_s,
        "step_cpu_s": step_cpu_s,
        "cpu_overhead_pct": 100 * tap_cpu_s / step_cpu_s if step_cpu_s else float("nan"),
    }


def _shipped_shape() -> tuple[int, tuple[int, ...], int] | None:
    """(d, hidden widths, outputs) of the predictor shipped with the tiny model, if any."""
    from star.model import tiny_model_path
    from star.predictor.model import default_checkpoint, load_checkpoint

    path = default_checkpoint(tiny_model_path())
    if path is None:
        return None
    cfg = load_checkpoint(path).config
    return cfg.input_dim, cfg.hidden_sizes, cfg.outputs


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--dims", default=f"{TINY_DIM},{PAPER_DIM}", help="hidden sizes (default %(default)s)"
    )
    parser.add_argument(
        "--batches", default=",".join(map(str, BATCHES)), help="batch sizes (default %(default)s)"
    )
    parser.add_argument(
        "--repeats", type=int, default=200, help="timed passes per cell (default %(default)s)"
    )
    parser.add_argument(
        "--threads", type=int, default=1, help="torch CPU threads (default %(default)s)"
    )
    parser.add_argument(
        "--no-gpu", action="store_true", help="skip the GPU even when one is present"
    )
    parser.add_argument("--json", action="store_true", help="print rows as JSON")
    parser.add_argument(
        "--engine",
        action="store_true",
        help="also measure the in-engine overhead with the tiny model and its shipped predictor",
    )
    parser.add_argument(
        "--engine-requests",
        type=int,
        default=64,
        help="concurrent requests for --engine (default %(default)s)",
    )
    parser.add_argument(
        "--every", type=int, default=20, help="k for --engine (default %(default)s)"
    )
    parser.add_argument(
        "--checkpoint",
        metavar="DIR",
        help="predictor for --engine (default: the one shipped with the tiny model); "
        "measure a candidate from `star predictor train` before shipping it",
    )


def run(args: argparse.Namespace) -> int:
    import torch

    try:
        dims = [int(s) for s in str(args.dims).split(",") if s.strip()]
        batches = [int(s) for s in str(args.batches).split(",") if s.strip()]
        if not dims or not batches or min(dims + batches) < 1 or args.repeats < 1:
            raise ValueError
    except ValueError:
        print(
            "bench predictor: --dims/--batches need positive integers, --repeats >= 1",
            file=sys.stderr,
        )
        return 2
    torch.set_num_threads(args.threads)
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() and not args.no_gpu else [])
    hidden = (2048, 512, 64)
    shapes: list[tuple[int, tuple[int, ...], int]] = [(d, hidden, 1) for d in dims]
    shipped = _shipped_shape()
    if shipped is not None and shipped not in shapes and shipped[0] in dims:
        shapes.append(shipped)  # the tiny model's own predictor
    rows = [
        time_mlp(d, b, dev, args.repeats, h, o)
        for dev in devices
        for d, h, o in shapes
        for b in batches
    ]
    overhead = None
    if args.engine:
        import asyncio

        from star.model import tiny_model_path
        from star.predictor.model import default_checkpoint

        ckpt = Path(args.checkpoint) if args.checkpoint else default_checkpoint(tiny_model_path())
        if ckpt is None or not ckpt.exists():
            what = f"no checkpoint at {ckpt}" if ckpt else "the tiny model ships no predictor"
            print(f"bench predictor: {what}", file=sys.stderr)
            return 1
        from star.logs import stdout_to_stderr

        with stdout_to_stderr():  # the engine's logs; stdout holds the table or --json alone
            overhead = asyncio.run(
                engine_overhead(str(tiny_model_path()), str(ckpt), args.engine_requests, args.every)
            )
    if args.json:
        print(json.dumps({"mlp": rows, "engine": overhead}, indent=1))
        return 0
    print(f"torch {torch.__version__}, CPU threads {args.threads}")
    table: list[tuple[object, ...]] = [
        ("device", "MLP", "params", "batch", "median ms", "p90 ms", "engine path ms")
    ]
    for r in rows:
        shape = "-".join(map(str, [r["dim"], *r["hidden"], r["outputs"]]))
        table.append(
            (
                r["device"],
                shape,
                f"{r['params']:,}",
                r["batch"],
                f"{r['median_ms']:.3f}",
                f"{r['p90_ms']:.3f}",
                f"{r['engine_median_ms']:.3f}",
            )
        )
    print(text_table(table, left=2))
    print("paper (GPU, d=3584): 1.33 ms at batch 1, 2.4 ms at batch 10")
    if overhead is not None:
        o = overhead
        print(
            f"\nin the engine's worker, tiny model, {o['requests']} requests, k={o['every']}, "
            f"{o['steps']} model steps of {o['mean_step_ms']:.2f} ms:\n"
            f"  {o['rounds']} prediction rounds of {o['mean_rows']:.1f} rows, "
            f"{o['mean_round_ms']:.3f} ms each; {o['mean_check_us']:.2f} us per other step\n"
            f"  tap {(o['predict_s'] + o['check_s']) * 1e3:.1f} ms of {o['step_s'] * 1e3:.0f} ms "
            f"-> {o['overhead_pct']:.2f} % wall-clock; thread CPU {o['tap_cpu_s'] * 1e3:.1f} of "
            f"{o['step_cpu_s'] * 1e3:.0f} ms -> {o['cpu_overhead_pct']:.2f} % "
            "(target <= 0.5 %, paper 0.38 %)"
        )
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m benchmarks.predictor``."""
    return bench_main("benchmarks.predictor", configure, run, __doc__, argv)


if __name__ == "__main__":
    sys.exit(main())
