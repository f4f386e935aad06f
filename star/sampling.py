"""Which sampling state survives a D->D migration, and how a continuation is sampled (docs/design.md §5.4).

A migration continues a request on another instance by submitting
prompt + every token the client has been sent as a new prompt, with the
budget reduced by what was generated. What depends only on the next token's
logits (temperature, top-p/k, min-p, logit bias, allowed / stop token ids,
``ignore_eos``) carries over unchanged; ``max_tokens`` and ``min_tokens``
are reduced. What depends on which tokens were *generated* or on a random
stream does not survive the re-submission, so such a request is refused
migration with the reason :func:`migration_blocker` gives:

* presence / frequency / repetition penalties (count generated tokens;
  repetition penalty also treats prompt tokens differently);
* ``seed`` (the seeded random stream restarts on the target);
* ``logprobs`` / ``prompt_logprobs`` (per-token bookkeeping; the target
  would also return prompt logprobs over the generated text);
* ``structured_outputs`` (the grammar's state is not carried);
* ``bad_words`` (multi-token words match against generated tokens);
* ``n > 1`` (several sequences share one request);
* ``logits_processors`` and anything else not known here.

The proxy (when it accepts a request) and the worker (in its reports) use this
one rule.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

_NEUTRAL = {"presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0}
_STATEFUL = ("seed", "logprobs", "prompt_logprobs", "structured_outputs", "bad_words")
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
        *_NEUTRAL,
        *_STATEFUL,
    }
)


def migration_blocker(sampling: Mapping[str, Any]) -> str | None:
    """Why a request with these ``SamplingParams`` keyword arguments cannot migrate (None: it can)."""
    try:
        if int(sampling.get("n", 1) or 1) != 1:
            return "n > 1"
        for key in _STATEFUL:
            value = sampling.get(key)
            if value is not None and value != [] and value is not False:
                return f"{key} is set"
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
