"""Does a migrated seeded request continue exactly on vLLM 0.32's GPU samplers? (issue 28)

Two questions, each answered with vLLM's own sampling code (copied here, see
the headers of ``vllm_v1_sampler.py`` and ``vllm_v2_gumbel.py``) on the
device given (``--device cuda`` on a GPU machine; ``cpu`` runs what can run
without one):

1. V1 model runner (``TopKTopPSampler.forward_native``: one
   ``q[i].exponential_(generator=...)`` over the vocabulary per seeded row
   per step). Does STAR's skip-ahead (:func:`workers.continuation.skip`, one
   ``randint`` a step) leave a request's generator where N sampler steps
   leave it, for several vocabulary sizes; do the tokens sampled after a
   restart at step k with the skip equal an unbroken run's; and what does
   STAR's start check (:func:`workers.continuation.skip_matches_sampler`)
   answer? ``replay`` (the sampler's own draw, repeated) is the control that
   always matches; no skip is the control that must not.
2. Model runner V2 (``gumbel_sample``: noise hashed from seed, position and
   token id). An unbroken run of N steps against the same request restarted
   at step k with fresh state, another batch slot and other neighbours: the
   same tokens? A position off by one and another seed are the controls that
   must differ. Needs CUDA and Triton.

``python -m benchmarks.gpu_continuation.check --device cuda --out r.json``
prints a report and writes the results as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import types
from collections.abc import Callable
from typing import Any

import torch

from benchmarks.gpu_continuation.vllm_v1_sampler import TopKTopPSampler

VOCABS = (64, 32_000, 151_936, 262_144)
"""Vocabulary sizes: a toy, Llama 2, Qwen2/DeepSeek-R1-Distill-Qwen, Gemma 3."""


def _continuation() -> Any:
    """``workers.continuation``; the GPU image has torch and Triton only, so no structlog."""
    try:
        import structlog  # noqa: F401
    except ImportError:
        shim = types.ModuleType("structlog")
        shim.get_logger = lambda *_a, **_k: types.SimpleNamespace(warning=lambda *_a, **_k: None)  # type: ignore[attr-defined]
        sys.modules["structlog"] = shim
    from workers import continuation

    return continuation


def _gen(device: str, seed: int) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(seed)


def _offset(gen: torch.Generator) -> int | None:
    return int(gen.get_offset()) if gen.device.type == "cuda" else None


def _same(a: torch.Generator, b: torch.Generator) -> bool:
    return bool(torch.equal(a.get_state(), b.get_state()))


def replay(
    gen: torch.Generator, steps: int, vocab: int, dtype: torch.dtype = torch.float32
) -> None:
    """The seeded draw of vLLM's ``random_sample`` (one row of ``vocab`` noise), ``steps`` times."""
    for _ in range(steps):
        torch.empty(vocab, dtype=dtype, device=gen.device).exponential_(generator=gen)


def _logits(step: int, vocab: int, rows: int = 3) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(1000 + step))


def _try(fn: Callable[[], Any]) -> tuple[Any, str | None]:
    try:
        return fn(), None
    except Exception as exc:
        return None, f"{type(exc).__name__}: {exc}"


def v1_states(device: str, vocabs: tuple[int, ...], steps: int = 5) -> list[dict[str, Any]]:
    """Generator state after ``steps`` sampler steps vs after STAR's skip and after a replay."""
    cont = _continuation()
    out = []
    for fp64 in (False, True):
        sampler = TopKTopPSampler(use_fp64_gumbel=fp64)
        for vocab in vocabs:
            stepped = _gen(device, 1234)
            start = _offset(stepped)
            logits = _logits(0, vocab).to(device)
            for _ in range(steps):
                # Row 1 seeded among unseeded rows, as in a batch.
                sampler(logits.clone(), {1: stepped}, None, None)
            end = _offset(stepped)
            skipped = _gen(device, 1234)
            _, skip_error = _try(lambda g=skipped: cont.skip(g, steps))
            replayed = _gen(device, 1234)
            replay(replayed, steps, vocab, torch.float64 if fp64 else torch.float32)
            check, check_error = _try(
                lambda s=sampler, v=vocab: cont.skip_matches_sampler(s, vocab=v, device=device)
            )
            out.append(
                {
                    "fp64_gumbel": fp64,
                    "vocab": vocab,
                    "steps": steps,
                    "offset_per_step": None if start is None else (end - start) / steps,
                    "star_skip_matches": None if skip_error else _same(stepped, skipped),
                    "star_skip_error": skip_error,
                    "replay_matches": _same(stepped, replayed),
                    "start_check": check,
                    "start_check_error": check_error,
                }
            )
    return out


def v1_tokens(
    device: str, vocab: int = 151_936, steps: int = 24, restarts: tuple[int, ...] = (1, 7, 23)
) -> list[dict[str, Any]]:
    """Tokens after a restart at step k (the request in another batch slot) vs an unbroken run."""
    cont = _continuation()
    sampler = TopKTopPSampler()
    seed = 7
    logits = [_logits(j, vocab) for j in range(steps)]
    gen = _gen(device, seed)
    unbroken = [
        int(sampler(logits[j].to(device), {1: gen}, None, None)[0][1]) for j in range(steps)
    ]
    out = []
    for k in restarts:
        row = {"restart_at": k, "steps": steps, "vocab": vocab}
        for how in ("star_skip", "replay", "no_skip"):
            g = _gen(device, seed)
            if how == "star_skip":
                _, err = _try(lambda g=g, k=k: cont.skip(g, k))
                if err:
                    row[how] = {"error": err}
                    continue
            elif how == "replay":
                replay(g, k, vocab)
            # Restarted: the request alone in row 0 of a batch of two.
            got = [
                int(sampler(logits[j][[1, 0]].to(device), {0: g}, None, None)[0][0])
                for j in range(k, steps)
            ]
            want = unbroken[k:]
            row[how] = {
                "equal": got == want,
                "matching": sum(a == b for a, b in zip(got, want, strict=True)),
                "of": len(want),
            }
        out.append(row)
    return out


def v1_start_check_before(device: str) -> bool:
    """STAR's start check as it ran before it took the engine's device: CPU generator, vocab 64."""
    return bool(_continuation().skip_matches_sampler(TopKTopPSampler()))


def v2_tokens(
    device: str, vocab: int = 151_936, steps: int = 24, restarts: tuple[int, ...] = (1, 7, 23)
) -> list[dict[str, Any]]:
    """Model runner V2: unbroken vs restarted at k with fresh state, the same sampler calls as vLLM's."""
    from benchmarks.gpu_continuation.vllm_v2_gumbel import apply_temperature, gumbel_sample

    max_reqs, prompt = 8, 37

    def sample(
        rows: list[torch.Tensor],
        slots: list[int],
        seeds: dict[int, int],
        temps: dict[int, float],
        pos: list[int],
        fp64: bool,
    ) -> list[int]:
        seed_t = torch.zeros(max_reqs, dtype=torch.int64)
        temp_t = torch.ones(max_reqs, dtype=torch.float32)
        for slot, s in seeds.items():
            seed_t[slot] = s
        for slot, t in temps.items():
            temp_t[slot] = t
        seed_t, temp_t = seed_t.to(device), temp_t.to(device)
        idx = torch.tensor(slots, dtype=torch.int64, device=device)
        logits = torch.stack(rows).to(device=device, dtype=torch.float32)
        # Sampler.apply_sampling_params then Sampler._sample_random (no top-k/top-p).
        apply_temperature(logits, idx, temp_t)
        sampled = gumbel_sample(
            logits,
            idx,
            temp_t,
            seed_t,
            torch.tensor(pos, dtype=torch.int64, device=device),
            apply_temperature=False,
            is_drafting=False,
            use_fp64=fp64,
        )
        return [int(t) for t in sampled.tolist()]

    out = []
    for fp64 in (False, True):
        seed, temp = 4242, 0.8
        req = [_logits(j, vocab, rows=1)[0] for j in range(steps)]
        other = [_logits(500 + j, vocab, rows=2) for j in range(steps)]
        # Unbroken: slot 3, between two other requests (slots 0 and 5).
        unbroken = [
            sample(
                [other[j][0], req[j], other[j][1]],
                [0, 3, 5],
                {0: 11, 3: seed, 5: -99},
                {0: 1.0, 3: temp, 5: 0.7},
                [80 + j, prompt - 1 + j, 12 + j],
                fp64,
            )[1]
            for j in range(steps)
        ]
        for k in restarts:
            row: dict[str, Any] = {"fp64_gumbel": fp64, "restart_at": k, "steps": steps}
            cases = {
                # Fresh state, slot 6, first of two, another neighbour.
                "restarted": (seed, 0),
                "pos_off_by_one": (seed, 1),
                "other_seed": (seed + 1, 0),
            }
            for name, (s, shift) in cases.items():
                got = [
                    sample(
                        [req[j], other[j][0]],
                        [6, 2],
                        {6: s, 2: 5},
                        {6: temp, 2: 1.3},
                        [prompt - 1 + j + shift, 40 + j],
                        fp64,
                    )[0]
                    for j in range(k, steps)
                ]
                want = unbroken[k:]
                row[name] = {
                    "equal": got == want,
                    "matching": sum(a == b for a, b in zip(got, want, strict=True)),
                    "of": len(want),
                }
            out.append(row)
    return out


def _interpreted() -> bool:
    """Triton's interpreter (``TRITON_INTERPRET=1``) runs the V2 kernels on the CPU, slowly."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def run(device: str, quick: bool = False) -> dict[str, Any]:
    """Every check that ``device`` can run; V2 on CUDA, or on the CPU under Triton's interpreter.

    ``quick``: small vocabularies and few steps (the test suite's CPU run).
    """
    info: dict[str, Any] = {
        "device": device,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "quick": quick,
    }
    vocabs = VOCABS[:2] if quick else VOCABS
    sizes: dict[str, Any] = {"vocab": 32_000, "steps": 8, "restarts": (1, 7)} if quick else {}
    if device.startswith("cuda"):
        props = torch.cuda.get_device_properties(device)
        info["device_name"] = props.name
        info["sm_count"] = props.multi_processor_count
        info["max_threads_per_sm"] = props.max_threads_per_multi_processor
        # PyTorch's calc_execution_policy: one Philox call of 4 values per thread
        # of a grid capped at SMs x (threads per SM / 256) blocks of 256; a
        # longer row needs a second call (offset + 8).
        edge = props.multi_processor_count * props.max_threads_per_multi_processor * 4
        info["one_call_vocab_limit"] = edge
        vocabs = (*VOCABS, edge, edge + 1)
    result: dict[str, Any] = {"info": info}
    result["v1_states"] = v1_states(device, vocabs)
    result["v1_tokens"] = v1_tokens(device, **sizes)
    result["v1_start_check_before"] = v1_start_check_before(device)
    if not device.startswith("cuda") and not _interpreted():
        result["v2_tokens"] = "skipped: needs CUDA, or TRITON_INTERPRET=1"
        return result
    try:
        import triton
    except ImportError:
        result["v2_tokens"] = "skipped: no triton"
        return result
    info["triton"] = triton.__version__
    info["triton_interpreter"] = _interpreted()
    small = {"vocab": 1024, "steps": 4, "restarts": (1, 3)}
    result["v2_tokens"] = v2_tokens(device, **(small if _interpreted() else sizes))
    return result


def report(result: dict[str, Any]) -> str:
    """The results as lines of text."""
    lines = [json.dumps(result["info"])]
    lines.append("V1 states: fp64 vocab steps offset/step | star_skip replay start_check (errors)")
    for r in result["v1_states"]:
        lines.append(
            f"  {r['fp64_gumbel']!s:5} {r['vocab']:>9} {r['steps']} {r['offset_per_step']} | "
            f"{r['star_skip_matches']} {r['replay_matches']} {r['start_check']}"
            + (f" (skip: {r['star_skip_error']})" if r["star_skip_error"] else "")
            + (f" (check: {r['start_check_error']})" if r["start_check_error"] else "")
        )
    lines.append("V1 tokens after a restart at k (matching/of):")
    for r in result["v1_tokens"]:
        parts = []
        for how in ("star_skip", "replay", "no_skip"):
            c = r[how]
            parts.append(
                f"{how} {c['error']}" if "error" in c else f"{how} {c['matching']}/{c['of']}"
            )
        lines.append(f"  k={r['restart_at']:>2} vocab {r['vocab']}: " + ", ".join(parts))
    lines.append(
        f"V1 start check as before (CPU generator, vocab 64): {result['v1_start_check_before']}"
    )
    v2 = result["v2_tokens"]
    if isinstance(v2, str):
        lines.append(f"V2: {v2}")
    else:
        lines.append("V2 tokens after a restart at k (matching/of):")
        for r in v2:
            lines.append(
                f"  fp64 {r['fp64_gumbel']!s:5} k={r['restart_at']:>2}: "
                + ", ".join(
                    f"{n} {r[n]['matching']}/{r[n]['of']}"
                    for n in ("restarted", "pos_off_by_one", "other_seed")
                )
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", help="write the results as JSON here")
    parser.add_argument("--quick", action="store_true", help="small sizes (the CPU test)")
    args = parser.parse_args(argv)
    result = run(args.device, quick=args.quick)
    print(report(result), flush=True)
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(result, fh, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
