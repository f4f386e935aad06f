"""``star predictor collect|train|eval``: the LLM-native length predictor (paper §4, docs/design.md §6)."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path
from typing import Any


def _sizes(text: str) -> tuple[int, ...]:
    try:
        out = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected widths like 2048,512,64, got {text!r}"
        ) from None
    if not out or any(v < 1 for v in out):
        raise argparse.ArgumentTypeError(f"expected positive widths like 2048,512,64, got {text!r}")
    return out


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from star.cli.common import add_settings_args
    from star.model import tiny_model_path

    parser = sub.add_parser(
        "predictor",
        help="collect data for, train and evaluate the length predictor",
        description=(
            "The LLM-native length predictor (paper §4): an MLP on the last-layer hidden state "
            "of a request's last token predicts its remaining output length. See docs/predictor.md."
        ),
    )
    inner = parser.add_subparsers(dest="predictor_command", metavar="ACTION", required=True)

    c = inner.add_parser(
        "collect",
        help="run generations through a real engine and store hidden states + remaining lengths",
        description=(
            "Runs sampled generations through a vLLM engine with the hidden-state tap and stores "
            "one row every --every decode steps per request (plus one at the end of the prompt) "
            "as safetensors shards plus index.json in --out. Resumable: run it again with the "
            "same settings and a larger --requests to add more."
        ),
    )
    c.add_argument(
        "--model",
        default=str(tiny_model_path()),
        help="model directory (default: the tiny demo model)",
    )
    c.add_argument(
        "--workload",
        default="synthetic",
        help="'synthetic' (the tiny model's task) or a JSON-lines file of prompts",
    )
    c.add_argument("--out", type=Path, required=True, metavar="DIR", help="data directory")
    c.add_argument(
        "--requests", type=int, default=1000, help="total requests (default: %(default)s)"
    )
    c.add_argument(
        "--samples-per-prompt",
        type=int,
        default=2,
        help="sampled answers per prompt (default: %(default)s)",
    )
    c.add_argument(
        "--batch",
        type=int,
        default=125,
        help="concurrent requests per round/shard (default: %(default)s)",
    )
    c.add_argument(
        "--every", type=int, default=20, help="a row every k decode steps (default: %(default)s)"
    )
    c.add_argument(
        "--seed", type=int, default=0, help="prompt and engine seed (default: %(default)s)"
    )
    c.add_argument(
        "--max-tokens", type=int, default=2048, help="max_tokens per request (default: %(default)s)"
    )
    c.add_argument("--quiet", action="store_true", help="no progress bar")
    c.set_defaults(func=run_collect)

    t = inner.add_parser(
        "train",
        help="train the MLP (L1, AdamW, early stopping, small grid search)",
        description=(
            "Splits DIR by prompt 70/15/15, trains with L1 loss and AdamW with early stopping on "
            "validation MAE, searches a small grid unless --no-search, and writes "
            "predictor.safetensors + predictor.json to --out."
        ),
    )
    t.add_argument(
        "data", type=Path, metavar="DIR", help="data directory from `star predictor collect`"
    )
    t.add_argument(
        "--out", type=Path, default=None, help="checkpoint directory (default: DIR/predictor)"
    )
    t.add_argument(
        "--hidden",
        type=_sizes,
        default=None,
        help="hidden widths, e.g. 256,64 (default: the setting predictor.hidden_sizes, 2048,512,64)",
    )
    t.add_argument(
        "--lr", type=float, default=1e-3, help="AdamW learning rate (default: %(default)s)"
    )
    t.add_argument(
        "--batch-size", type=int, default=256, help="minibatch size (default: %(default)s)"
    )
    t.add_argument("--max-epochs", type=int, default=200, help="(default: %(default)s)")
    t.add_argument(
        "--patience",
        type=int,
        default=10,
        help="early-stopping patience in epochs (default: %(default)s)",
    )
    t.add_argument(
        "--log-target", action="store_true", help="regress log1p of the remaining length"
    )
    t.add_argument(
        "--no-uncertainty",
        action="store_true",
        help="one output only (the paper's MLP): no error-scale output, the served R-hat "
        "then averages rounds with equal weights",
    )
    t.add_argument("--no-search", action="store_true", help="train only the given configuration")
    t.add_argument("--seed", type=int, default=0, help="split and init seed (default: %(default)s)")
    t.add_argument(
        "--threads", type=int, default=1, help="torch CPU threads (default: %(default)s)"
    )
    t.add_argument("--quiet", action="store_true", help="no progress bar")
    add_settings_args(t)
    t.set_defaults(func=run_train)

    e = inner.add_parser(
        "eval",
        help="MAE, NMAE, Kendall tau on the test split, by bucket, next to the baselines",
        description=(
            "Evaluates a checkpoint on DIR's test split (the split train used): the MLP, a "
            "constant, prompt-only and 2/4/6-bin predictors, overall, by tokens generated and by "
            "true length."
        ),
    )
    e.add_argument("data", type=Path, metavar="DIR", help="data directory")
    e.add_argument(
        "--checkpoint", type=Path, default=None, help="checkpoint (default: DIR/predictor)"
    )
    e.add_argument("--json", action="store_true", help="print rows as JSON")
    e.add_argument(
        "--plot", type=Path, default=None, metavar="PNG", help="write MAE-by-bucket plots here"
    )
    e.set_defaults(func=run_eval)


def _err(msg: str) -> int:
    print(f"star predictor: error: {msg}", file=sys.stderr)
    return 2


def run_collect(args: argparse.Namespace) -> int:
    from star.predictor.collect import stats_line
    from star.predictor.dataset import DatasetError
    from workers.collect import CollectConfig, collect

    if min(args.requests, args.samples_per_prompt, args.batch, args.every, args.max_tokens) < 1:
        return _err(
            "--requests, --samples-per-prompt, --batch, --every and --max-tokens must be >= 1"
        )
    if args.workload != "synthetic" and not Path(args.workload).is_file():
        return _err(f"--workload {args.workload!r} is neither 'synthetic' nor a file")
    cfg = CollectConfig(
        model=args.model,
        out=args.out,
        workload=args.workload,
        requests=args.requests,
        samples_per_prompt=args.samples_per_prompt,
        batch=args.batch,
        every=args.every,
        seed=args.seed,
        max_tokens=args.max_tokens,
    )
    try:
        data = asyncio.run(collect(cfg, progress=not args.quiet))
    except DatasetError as exc:
        return _err(str(exc))
    print(stats_line(data))
    return 0


def _load(data_dir: Path) -> Any:
    from star.predictor.dataset import DataDir

    data = DataDir(data_dir)
    return data, data.load()


def run_train(args: argparse.Namespace) -> int:
    import torch

    from star.cli.common import settings_from_args
    from star.predictor import evaluate as ev
    from star.predictor import train as tr
    from star.predictor.dataset import DatasetError
    from star.settings import SettingsError

    try:
        # --hidden wins over predictor.hidden_sizes (file < env < --set).
        settings = settings_from_args(args, {"predictor.hidden_sizes": args.hidden})
    except SettingsError as exc:
        return _err(str(exc))
    torch.set_num_threads(args.threads)
    try:
        data, samples = _load(args.data)
    except DatasetError as exc:
        return _err(str(exc))
    base = tr.TrainConfig(
        hidden_sizes=settings.predictor.hidden_sizes,
        lr=args.lr,
        batch_size=args.batch_size,
        max_epochs=args.max_epochs,
        patience=args.patience,
        log_target=args.log_target,
        uncertainty=not args.no_uncertainty,
        seed=args.seed,
    )
    out = args.out or args.data / "predictor"
    try:
        done = tr.train_checkpoint(
            data,
            samples,
            base,
            out,
            grid=not args.no_search,
            seed=args.seed,
            progress=not args.quiet,
        )
    except ValueError as exc:
        return _err(str(exc))
    print(f"{'configuration':<36}{'val MAE':>9}{'epochs':>8}{'best':>6}{'s':>7}")
    for r in done.results:
        mark = " *" if r is done.best else ""
        print(
            f"{r.config.label():<36}{r.val_mae:>9.1f}{r.epochs:>8}{r.best_epoch:>6}{r.seconds:>7.0f}{mark}"
        )
    print(f"\ntest split ({len(done.splits['test'])} rows), MAE in tokens:")
    print(ev.format_table([r for r in done.rows if r.bucket == "all"]))
    print(f"\nwrote {out}")
    return 0


def run_eval(args: argparse.Namespace) -> int:
    from star.predictor import evaluate as ev
    from star.predictor import train as tr
    from star.predictor.dataset import DatasetError
    from star.predictor.model import CheckpointError, load_checkpoint

    try:
        data, samples = _load(args.data)
        ckpt = load_checkpoint(args.checkpoint or args.data / "predictor")
    except (DatasetError, CheckpointError) as exc:
        return _err(str(exc))
    if ckpt.config.input_dim != samples.dim:
        return _err(
            f"checkpoint expects hidden size {ckpt.config.input_dim}, the data has {samples.dim}"
        )
    splits = tr.split(samples, int(ckpt.metadata.get("split_seed", 0)))
    max_tokens = tr.collected_max_tokens(data.index["meta"])
    preds = ev.predictions(ckpt.model, splits["test"], splits["train"], max_tokens)
    rows = ev.evaluate(ckpt.model, splits["test"], splits["train"], max_tokens, preds)
    if args.json:
        print(json.dumps(ev.as_dicts(rows), indent=1))
    else:
        cfg = ckpt.config
        print(
            f"test split: {len(splits['test'])} rows; MAE in tokens; served fusion "
            f"decay {cfg.decay:g}, power {cfg.power:g}, first weight {cfg.first_weight:g}"
            f"{'' if cfg.uncertainty else ' (no error-scale output: equal weights)'}"
        )
        print(ev.format_table(rows))
        print(ev.clip_note(preds, splits["test"], max_tokens))
        print()
        print(ev.format_trend(ev.trend(splits["test"], preds["mlp-fused"])))
    if args.plot is not None:
        ev.plot(rows, args.plot, title=f"length predictor, {data.index['meta']['model']}")
        if not args.json:
            print(f"wrote {args.plot}")
    return 0
