"""``star bench serve``: a load generator for the proxy (or any OpenAI-API server).

Requests arrive as a Poisson process at ``--rate`` per second (exponential
gaps, seeded; ``--rate inf`` sends all at once), each streamed to the end
while the next ones start. Prompts come from the tiny model's countdown-list
task (``star.model.task``: answer lengths depend on the prompt and on
sampling, so load is heavy-tailed as in the paper's §6) or from a
ShareGPT-format JSON file (first human turn = prompt, the recorded answer's
length in tokens = ``max_tokens``, as vLLM's benchmark does).

Per request: TTFT (first text chunk), TPOT ((e2e - TTFT) / (tokens - 1)),
inter-token gaps, end-to-end latency. Summary: request and token
throughput, mean / median / p99 of each, and goodput -- completed requests
per second that met the SLO (TTFT <= ``--slo-ttft-ms`` and TPOT <=
``--slo-tpot-ms``), DistServe's definition that the paper uses (§6.1).

    star bench serve --url http://127.0.0.1:8000 --rate 2 --num-prompts 50
    star bench serve --dataset sharegpt.json --rate 4 --json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.client import Timing, payload, stream_once
from benchmarks.common import bench_main, text_table


@dataclass(frozen=True, slots=True)
class BenchRequest:
    """One request to send: chat messages (or text) and its output budget."""

    prompt: str | list[dict[str, str]]
    max_tokens: int


@dataclass(frozen=True, slots=True)
class Slo:
    """Service-level objective of goodput (milliseconds)."""

    ttft_ms: float
    tpot_ms: float


def arrival_times(n: int, rate: float, rng: np.random.Generator) -> list[float]:
    """Send times (s from the start) of ``n`` Poisson arrivals at ``rate`` per second.

    The first request goes at 0; ``rate`` = inf sends everything at once.
    """
    if n <= 0:
        return []
    if not rate > 0:
        raise ValueError(f"rate must be > 0, got {rate}")
    if math.isinf(rate):
        return [0.0] * n
    gaps = rng.exponential(1.0 / rate, size=n - 1)
    return [0.0, *np.cumsum(gaps).tolist()]


def task_requests(
    n: int, rng: np.random.Generator, sizes: Sequence[str], max_tokens: int
) -> list[BenchRequest]:
    """``n`` chat requests of the tiny model's countdown-list task."""
    from star.model.task import SIZES, sample_prompt

    unknown = sorted(set(sizes) - set(SIZES))
    if unknown:
        raise ValueError(f"unknown task size(s) {unknown}; choose from {sorted(SIZES)}")
    return [BenchRequest(sample_prompt(rng, sizes).messages(), max_tokens) for _ in range(n)]


def sharegpt_requests(
    path: Path, n: int, rng: np.random.Generator, count_tokens: Any, max_tokens: int
) -> list[BenchRequest]:
    """``n`` requests from a ShareGPT JSON file (a list of ``{"conversations": [...]}``).

    Entries need a human turn followed by a gpt turn; the answer's token
    count (by ``count_tokens(text)``, at most ``max_tokens``) is the request's
    ``max_tokens``. Entries are shuffled with ``rng``; fewer than ``n`` usable
    entries are reused in order.
    """
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path}: not a readable JSON file: {exc}") from None
    if not isinstance(data, list):
        raise ValueError(
            f"{path}: expected a JSON list of conversations, got {type(data).__name__}"
        )
    usable: list[BenchRequest] = []
    for item in data:
        turns = item.get("conversations") if isinstance(item, dict) else None
        if not isinstance(turns, list) or len(turns) < 2:
            continue
        first, second = turns[0], turns[1]
        if not (isinstance(first, dict) and isinstance(second, dict)):
            continue
        if first.get("from") not in ("human", "user") or second.get("from") not in (
            "gpt",
            "assistant",
        ):
            continue
        prompt, answer = str(first.get("value") or ""), str(second.get("value") or "")
        if not prompt:
            continue
        usable.append(
            BenchRequest(
                [{"role": "user", "content": prompt}], max(1, min(max_tokens, count_tokens(answer)))
            )
        )
    if not usable:
        raise ValueError(f"{path}: no conversation with a human turn followed by a gpt turn")
    order = rng.permutation(len(usable))
    return [usable[int(order[i % len(usable)])] for i in range(n)]


def _stats(values: Sequence[float], scale: float = 1000.0) -> dict[str, float]:
    if not values:
        return {"mean": math.nan, "median": math.nan, "p99": math.nan}
    arr = np.asarray(values, dtype=float) * scale
    return {
        "mean": float(arr.mean()),
        "median": float(np.median(arr)),
        "p99": float(np.percentile(arr, 99)),
    }


def summarize(timings: Sequence[Timing], duration_s: float, slo: Slo) -> dict[str, Any]:
    """The benchmark's numbers (latencies in ms) from per-request timings."""
    ok = [t for t in timings if t.ok]
    tpots = [t.tpot_s for t in ok if t.tpot_s is not None]
    good = [
        t
        for t in ok
        if t.ttft_s * 1000 <= slo.ttft_ms and (t.tpot_s is None or t.tpot_s * 1000 <= slo.tpot_ms)
    ]
    out_tokens = sum(t.output_tokens for t in ok)
    in_tokens = sum(t.prompt_tokens for t in ok)
    dur = max(duration_s, 1e-9)
    errors: dict[str, int] = {}
    for t in timings:
        if not t.ok:
            errors[t.error[:120]] = errors.get(t.error[:120], 0) + 1
    return {
        "requests": len(timings),
        "completed": len(ok),
        "failed": len(timings) - len(ok),
        "duration_s": duration_s,
        "request_throughput": len(ok) / dur,
        "output_token_throughput": out_tokens / dur,
        "total_token_throughput": (out_tokens + in_tokens) / dur,
        "prompt_tokens": in_tokens,
        "output_tokens": out_tokens,
        "ttft_ms": _stats([t.ttft_s for t in ok]),
        "tpot_ms": _stats(tpots),
        "itl_ms": _stats([g for t in ok for g in t.itl_s]),
        "e2e_ms": _stats([t.e2e_s for t in ok]),
        "slo": asdict(slo),
        "goodput": len(good) / dur,
        "slo_attainment": len(good) / len(timings) if timings else math.nan,
        "errors": errors,
    }


def table(summary: dict[str, Any], title: str) -> str:
    """``summary`` as a two-column text table."""
    rows: list[tuple[str, str]] = [
        ("requests completed / failed", f"{summary['completed']} / {summary['failed']}"),
        ("duration (s)", f"{summary['duration_s']:.2f}"),
        ("request throughput (req/s)", f"{summary['request_throughput']:.3f}"),
        ("output token throughput (tok/s)", f"{summary['output_token_throughput']:.1f}"),
        ("total token throughput (tok/s)", f"{summary['total_token_throughput']:.1f}"),
        ("prompt / output tokens", f"{summary['prompt_tokens']} / {summary['output_tokens']}"),
    ]
    for key, name in (
        ("ttft_ms", "TTFT"),
        ("tpot_ms", "TPOT"),
        ("itl_ms", "ITL"),
        ("e2e_ms", "E2E latency"),
    ):
        s = summary[key]
        rows.append(
            (
                f"{name} mean / median / p99 (ms)",
                f"{s['mean']:.1f} / {s['median']:.1f} / {s['p99']:.1f}",
            )
        )
    slo = summary["slo"]
    rows.append(
        (
            f"goodput (req/s, TTFT<={slo['ttft_ms']:g}ms, TPOT<={slo['tpot_ms']:g}ms)",
            f"{summary['goodput']:.3f}",
        )
    )
    rows.append(("SLO attainment", f"{100 * summary['slo_attainment']:.1f} %"))
    for error, count in summary["errors"].items():
        rows.append((f"error x{count}", error))
    width = max(len(k) for k, _ in rows)
    line = "=" * (width + 24)
    return "\n".join([line, title.center(len(line)), line, text_table(rows, left=2), line])


async def drive(
    url: str,
    endpoint: str,
    model: str,
    requests: Sequence[BenchRequest],
    times: Sequence[float],
    extra: dict[str, Any],
    headers: dict[str, str],
    timeout_s: float,
    progress: bool,
    max_concurrency: int | None = None,
) -> tuple[list[Timing], float]:
    """Send ``requests`` at ``times``; return their timings and the wall duration."""
    import httpx
    from tqdm import tqdm

    path = "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"
    limits = httpx.Limits(max_connections=max_concurrency or 10_000, max_keepalive_connections=64)
    bar = tqdm(total=len(requests), disable=not progress, unit="req", file=sys.stderr)
    gate = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    results: list[Timing | None] = [None] * len(requests)
    async with httpx.AsyncClient(
        base_url=url, headers=headers, timeout=timeout_s, limits=limits
    ) as client:
        start = time.perf_counter()

        async def one(i: int) -> None:
            delay = times[i] - (time.perf_counter() - start)
            if delay > 0:
                await asyncio.sleep(delay)
            body = payload(endpoint, model, requests[i].prompt, requests[i].max_tokens, extra)
            if gate is None:
                results[i] = await stream_once(client, path, body)
            else:
                async with gate:
                    results[i] = await stream_once(client, path, body)
            bar.update(1)

        async with asyncio.TaskGroup() as tg:
            for i in range(len(requests)):
                tg.create_task(one(i))
        duration = time.perf_counter() - start
    bar.close()
    return [r for r in results if r is not None], duration


def configure(parser: argparse.ArgumentParser) -> None:
    """Add this benchmark's flags to ``parser`` (``star bench serve`` and ``-m``)."""
    parser.add_argument(
        "--url", default="http://127.0.0.1:8000", help="server base URL (default %(default)s)"
    )
    parser.add_argument(
        "--model", default="star-tiny", help="model name to request (default %(default)s)"
    )
    parser.add_argument("--api-key", default=None, help="bearer token, if the proxy wants one")
    parser.add_argument(
        "--rate",
        type=float,
        default=1.0,
        help="Poisson arrival rate, requests/s; inf = all at once",
    )
    parser.add_argument(
        "--num-prompts", type=int, default=50, help="requests to send (default %(default)s)"
    )
    parser.add_argument(
        "--max-concurrency", type=int, default=None, help="cap on requests in flight"
    )
    parser.add_argument(
        "--dataset",
        default="task",
        help="'task' (the tiny model's task, default) or a ShareGPT JSON file",
    )
    parser.add_argument(
        "--sizes",
        default="tiny,short,medium,long",
        help="task list sizes to draw from (default %(default)s)",
    )
    parser.add_argument(
        "--endpoint", choices=["chat", "completions"], default="chat", help="API (default chat)"
    )
    parser.add_argument(
        "--max-tokens",
        type=int,
        default=1024,
        help="output budget per request (default %(default)s)",
    )
    parser.add_argument(
        "--temperature", type=float, default=1.0, help="sampling temperature (default %(default)s)"
    )
    parser.add_argument("--ignore-eos", action="store_true", help="always generate max_tokens")
    parser.add_argument(
        "--tokenizer",
        default=None,
        help="tokenizer.json dir for ShareGPT lengths (default: tiny model)",
    )
    parser.add_argument(
        "--seed", type=int, default=0, help="seed of prompts and arrivals (default 0)"
    )
    parser.add_argument(
        "--slo-ttft-ms",
        type=float,
        default=2000.0,
        help="goodput SLO on TTFT (default %(default)s)",
    )
    parser.add_argument(
        "--slo-tpot-ms", type=float, default=100.0, help="goodput SLO on TPOT (default %(default)s)"
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=600.0,
        help="per-request timeout in s (default %(default)s)",
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--json", action="store_true", help="print the summary as JSON")


def build_requests(args: argparse.Namespace, rng: np.random.Generator) -> list[BenchRequest]:
    """The request list the flags describe (raises ValueError on bad input)."""
    if args.num_prompts < 1:
        raise ValueError(f"--num-prompts must be >= 1, got {args.num_prompts}")
    if args.max_tokens < 1:
        raise ValueError(f"--max-tokens must be >= 1, got {args.max_tokens}")
    if args.dataset == "task":
        sizes = [s.strip() for s in str(args.sizes).split(",") if s.strip()]
        return task_requests(args.num_prompts, rng, sizes, args.max_tokens)
    from tokenizers import Tokenizer

    from star.model import tiny_model_path

    tok = Tokenizer.from_file(str(Path(args.tokenizer or tiny_model_path()) / "tokenizer.json"))
    return sharegpt_requests(
        Path(args.dataset),
        args.num_prompts,
        rng,
        lambda text: len(tok.encode(text).ids),
        args.max_tokens,
    )


def run(args: argparse.Namespace) -> int:
    """Run the benchmark described by ``args``; print a table or ``--json``."""
    rng = np.random.default_rng(args.seed)
    try:
        requests = build_requests(args, rng)
        times = arrival_times(len(requests), args.rate, rng)
    except ValueError as exc:
        print(f"bench serve: {exc}", file=sys.stderr)
        return 2
    if args.endpoint == "completions" and args.dataset == "task":
        from proxy.tokenizer import ModelCard
        from star.model import tiny_model_path

        card = ModelCard.load(tiny_model_path())
        requests = [
            BenchRequest(
                card.render_chat(r.prompt) if isinstance(r.prompt, list) else r.prompt, r.max_tokens
            )
            for r in requests
        ]
    extra: dict[str, Any] = {"temperature": args.temperature}
    if args.ignore_eos:
        extra["ignore_eos"] = True
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    import uvloop

    timings, duration = uvloop.run(
        drive(
            args.url.rstrip("/"),
            args.endpoint,
            args.model,
            requests,
            times,
            extra,
            headers,
            args.timeout,
            not args.no_progress and not args.json,
            args.max_concurrency,
        )
    )
    summary = summarize(timings, duration, Slo(args.slo_ttft_ms, args.slo_tpot_ms))
    summary["config"] = {
        "url": args.url,
        "rate": args.rate,
        "num_prompts": args.num_prompts,
        "dataset": args.dataset,
        "endpoint": args.endpoint,
        "temperature": args.temperature,
        "max_tokens": args.max_tokens,
        "seed": args.seed,
    }
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        title = f"star bench serve: {args.num_prompts} requests at {args.rate:g}/s ({args.dataset})"
        print(table(summary, title))
    return 0 if summary["completed"] else 1


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m benchmarks.serve``."""
    return bench_main("benchmarks.serve", configure, run, __doc__, argv)


if __name__ == "__main__":
    sys.exit(main())
