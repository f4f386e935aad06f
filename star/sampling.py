"""Which sampling state survives a D->D migration, and how a continuation is sampled (docs/design.md §5.2).

A migration continues a request on another instance as a *true
continuation* (``worker.true_continuation``, the default): the target gets
the original prompt, the original sampling parameters and budgets, and the
tokens generated so far as the request's output tokens (their KV pulled
through NIXL or recomputed). Penalties, ``min_tokens``, ``bad_words`` and
stop token ids read those outputs, a structured-output grammar is advanced
over them, the logprobs of the new tokens are the target's own, and a
seeded random stream is skipped ahead by one draw per generated token where
the engine proved at start that its sampler draws exactly that
(``workers.continuation``), so all of them continue exactly.
``prompt_logprobs`` migrate too: they are computed once, with the prompt
(on the prefill worker, or on a decode worker prefilling the request
itself), and sent with the first token, before any release is possible; a
continuation, or a decode leg whose KV was computed elsewhere, never
computes them again (``workers.engine_config.sampling_params`` drops the
parameter there).
What still cannot migrate is refused with the reason :func:`migration_blocker`
gives:

* ``n > 1`` (several sequences share one request);
* ``seed`` on an engine whose sampler the skip-ahead does not match;
* ``logits_processors`` and anything else not known here.

With ``worker.true_continuation`` off, a continuation is a new request whose
prompt is the old prompt plus every generated token, budgets reduced
(:func:`continuation`); then what depends on which tokens were generated or
on a random stream does not survive, and ``resume=False`` gives the stricter
rule: penalties, ``seed``, ``bad_words``, structured outputs and ``logprobs``
are refused too.

The proxy (when it accepts a request) and the worker (in its reports, and
when asked to release) use this one rule.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

_NEUTRAL = {"presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0}
_STATEFUL = ("seed", "logprobs", "structured_outputs", "bad_words")
# What a true continuation does not carry (the rest of _STATEFUL it does).
_NOT_RESUMED: tuple[str, ...] = ()
_CARRIED = frozenset(
    {
        "max_tokens",
        "min_tokens",
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "logit_bias",
        "allowed_token_ids",
        "stop_token_ids",
        "ignore_eos",
        "stop",
        "include_stop_str_in_output",
        "skip_special_tokens",
        "spaces_between_special_tokens",
        "detokenize",
        "n",
        "prompt_logprobs",
        # Where the reasoning ends in the *original* prompt, and the engine's
        # reasoning parser's arguments (workers.engine_config.reasoning_hints):
        # a true continuation keeps that prompt, and its grammar replay finds
        # the end among the generated tokens as the source's engine did.
        "reasoning_ended",
        "reasoning_parser_kwargs",
        *_NEUTRAL,
        *_STATEFUL,
    }
)


def migration_blocker(
    sampling: Mapping[str, Any], *, resume: bool = True, seeded: bool = True
) -> str | None:
    """Why a request with these ``SamplingParams`` keyword arguments cannot migrate (None: it can).

    ``resume``: migrations continue as true continuations; False: by
    re-submission (prompt + generated tokens, :func:`continuation`).
    ``seeded``: the engine's seeded sampling can be skipped ahead exactly.
    """
    try:
        if int(sampling.get("n", 1) or 1) != 1:
            return "n > 1"
        stateful = _NOT_RESUMED if resume else _STATEFUL
        for key in stateful:
            value = sampling.get(key)
            if value is not None and value != [] and value is not False:
                return f"{key} is set"
        if resume and not seeded and sampling.get("seed") is not None:
            return "seed is set (this engine's sampler cannot be skipped ahead exactly)"
        if not resume:
            for key, neutral in _NEUTRAL.items():
                value = sampling.get(key)
                if value is not None and float(value) != neutral:
                    return f"{key} is {value}"
    except (TypeError, ValueError):
        return "unreadable sampling parameters"
    unknown = sorted(k for k in sampling if k not in _CARRIED)
    if unknown:
        return f"sampling parameter {unknown[0]} is not carried across a migration"
    return None


def continuation(sampling: Mapping[str, Any], generated: int) -> dict[str, Any]:
    """The sampling of a request continued after ``generated`` tokens (budgets reduced).

    Raises ValueError when nothing is left to generate.
    """
    out = dict(sampling)
    left = int(out["max_tokens"]) - generated
    if left < 1:
        raise ValueError(f"no tokens left: max_tokens {out['max_tokens']}, generated {generated}")
    out["max_tokens"] = left
    if out.get("min_tokens"):
        out["min_tokens"] = max(int(out["min_tokens"]) - generated, 0)
    return out
