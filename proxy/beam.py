"""Beam search (``use_beam_search``) as vLLM 0.32's server runs it, one token a step.

vLLM's server does not beam-search in the engine: ``BeamSearchOnlineMixin.beam_search``
(``vllm/entrypoints/generate/beam_search/online.py``) sends, each step, one
request per live beam for a single token with the ``2 x width`` top logprobs,
extends every beam by every candidate, keeps the ``width`` best by cumulative
logprob, sets aside a beam whose candidate is the end token, and at the end
ranks finished and live beams by the length-penalised score. :func:`search`
is that loop over any ``step`` (the proxy's: an ordinary one-token request
through the fleet, :mod:`proxy.app`), its ties broken as vLLM's numpy calls
break them, so the same logprobs give the same beams.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from proxy.backend import BackendError, TokenBatch

Step = Callable[[list[int]], Awaitable[TokenBatch]]
"""One engine step of a beam: its tokens (prompt first) in, one token with logprobs out."""


@dataclass(frozen=True, slots=True)
class BeamParams:
    """vLLM's ``BeamSearchParams`` (what ``CompletionRequest.to_beam_search_params`` keeps)."""

    width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 1.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False

    def within(self, room: int) -> BeamParams:
        """These, ``max_tokens`` clamped to the ``room`` a prompt leaves of the context."""
        return dataclasses.replace(self, max_tokens=min(self.max_tokens, room))

    def sampling(self) -> dict[str, float | int]:
        """The one-token request of a step (vLLM's ``SamplingParams`` there)."""
        return {"max_tokens": 1, "temperature": self.temperature, "logprobs": 2 * self.width}


@dataclass(slots=True)
class Beam:
    """One sequence: ``tokens`` are the prompt's and the generated ones."""

    tokens: list[int]
    cum_logprob: float = 0.0
    finish_reason: str | None = None
    stop_reason: int | None = None
    logprobs: list[dict[int, float]] = field(default_factory=list)


def candidates_of(batch: TokenBatch) -> dict[int, float]:
    """A step's logprobs as vLLM's ``dict[int, Logprob]``: the sampled token first, then
    the top ones in rank order (a repeated id keeps its first place)."""
    if not batch.token_ids or batch.logprobs is None:
        raise BackendError("a beam search step came back without its token's logprobs")
    out = {batch.token_ids[0]: batch.logprobs[0]}
    k = len(batch.top_ids or []) // len(batch.token_ids)
    for tid, lp in zip((batch.top_ids or [])[:k], (batch.top_logprobs or [])[:k], strict=True):
        out[tid] = lp
    return out


def score(beam: Beam, eos: int | None, length_penalty: float) -> float:
    """vLLM's ``get_beam_search_score`` (the length counts the prompt, not a final EOS)."""
    length = len(beam.tokens) - (1 if beam.tokens and beam.tokens[-1] == eos else 0)
    return float(beam.cum_logprob / (max(length, 1) ** length_penalty))


async def search(
    prompt: Sequence[int], params: BeamParams, eos: int | None, step: Step
) -> list[Beam]:
    """The ``params.width`` best beams after ``prompt``, best first."""
    live = [Beam(list(prompt))]
    done: list[Beam] = []
    for _ in range(params.max_tokens):
        outs = await asyncio.gather(*(step(b.tokens) for b in live))
        if any(o.finish_reason == "abort" for o in outs):
            for b in live:
                b.finish_reason = "abort"
            break
        scored: list[tuple[float, int, Beam, dict[int, float]]] = []
        for beam, out in zip(live, outs, strict=True):
            logprobs = candidates_of(out)
            for tid, lp in logprobs.items():
                total = beam.cum_logprob + lp
                if tid == eos and not params.ignore_eos:
                    tokens = (
                        [*beam.tokens, tid] if params.include_stop_str_in_output else beam.tokens
                    )
                    done.append(Beam(tokens, total, "stop", eos, [*beam.logprobs, logprobs]))
                else:
                    scored.append((total, tid, beam, logprobs))
        values = np.fromiter((c[0] for c in scored), dtype=np.float64, count=len(scored))
        if len(scored) <= params.width:
            best = np.argsort(-values)
        else:
            best = np.argpartition(-values, params.width - 1)[: params.width]
            best = best[np.argsort(-values[best])]
        live = []
        for i in best:
            total, tid, beam, logprobs = scored[int(i)]
            live.append(Beam([*beam.tokens, tid], total, None, None, [*beam.logprobs, logprobs]))
        if not live:
            break
    ranked = sorted(done + live, key=lambda b: score(b, eos, params.length_penalty), reverse=True)
    return ranked[: params.width]


def generated(beam: Beam, prompt_len: int) -> list[int]:
    """A beam's output token ids (vLLM's ``CompletionOutput.token_ids``)."""
    return beam.tokens[prompt_len:]
