"""Logprobs in the shapes vLLM 0.32's OpenAI server gives them, sans-IO.

The engine sends, per generated token, its logprob and the ``k`` most likely
tokens with theirs (:class:`star.wire.LogprobTokens`); this module renders
them as ``vllm/entrypoints/openai`` does:

* each position is vLLM's ``dict[int, Logprob]``: the sampled token first,
  then the top ``k`` in rank order, a token already there keeping its place
  (so ``k`` entries when the sampled token is among the top ``k``, else
  ``k + 1``);
* token strings are vLLM's output processor's (``LogprobsProcessor``):
  each id decoded alone with special tokens (``convert_ids_list_to_tokens``,
  leading spaces of a Metaspace piece restored), and a string ending in
  U+FFFD (part of a UTF-8 character) decoded again after up to 4 preceding
  sampled tokens (``_verify_tokens``);
* completions (``logprobs: k``): ``{text_offset, token_logprobs, tokens,
  top_logprobs}``, ``top_logprobs`` a map of the first ``k + 1`` entries by
  token string, ``text_offset`` counting the token strings' characters;
* chat (``logprobs: true``, ``top_logprobs: k``): ``{content: [{token,
  logprob, bytes, top_logprobs: [...]}]}``, the first ``k`` entries, ``bytes``
  the string's UTF-8 (errors replaced);
* every logprob written as ``max(logprob, -9999.0)`` (``-inf`` included).

Prompt logprobs (:class:`star.wire.PromptLogprobs`, vLLM's ``prompt_logprobs``)
are rendered as vLLM's engine and server render them: position 0 ``None``,
then per prompt token a map of id to ``{logprob, rank, decoded_token}``, the
prompt token first with its rank, then the top ``k`` ranked ``1..k`` (a token
already there keeping its place and taking the later entry), the names
corrected after up to 4 preceding *prompt* tokens (:func:`prompt_entries`,
:func:`prompt_logprobs_json`); completions' ``echo`` puts them before the
generated tokens' in the ``logprobs`` object, the first prompt token with
``null`` logprob and top map (:meth:`ChoiceLogprobs.take_prompt`).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from tokenizers import Tokenizer

from star.wire import PromptLogprobs

MIN_LOGPROB = -9999.0
"""The least logprob written (vLLM's, OpenAI's): ``-inf`` and below become this."""
MAX_LOGPROBS = 20
"""Top tokens a request may ask for: vLLM's ``max_logprobs`` default, which STAR's
engines keep (``workers.engine_config`` does not set it)."""
MAX_CHAT_TOP_LOGPROBS = 20
"""OpenAI's bound on chat ``top_logprobs``."""
_CONTEXT = 4  # sampled tokens vLLM decodes before a partial character
_REPLACEMENT = "\ufffd"


def _space_marker(tokenizer: Tokenizer) -> str | None:
    """The Metaspace replacement character, or None (vLLM's ``get_leading_space_marker``)."""
    try:
        pre = json.loads(tokenizer.to_str()).get("pre_tokenizer") or {}
    except (ValueError, TypeError, AttributeError):
        return None
    if pre.get("type") == "Metaspace":
        return str(pre.get("replacement", "\u2581"))
    if pre.get("type") == "Sequence":
        for sub in pre.get("pretokenizers", []):
            if sub.get("type") == "Metaspace":
                return str(sub.get("replacement", "\u2581"))
    return None


class TokenNames:
    """Token strings as vLLM renders them in logprobs; one per tokenizer and request."""

    __slots__ = ("_marker", "_pieces", "_tok")

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tok = tokenizer
        self._marker = _space_marker(tokenizer)
        self._pieces: dict[int, str] = {}

    def piece(self, token_id: int) -> str:
        """One id decoded alone (``convert_ids_list_to_tokens``)."""
        text = self._pieces.get(token_id)
        if text is None:
            text = self._decode([token_id])
            if self._marker is not None:
                raw = self._tok.id_to_token(token_id) or ""
                markers = len(raw) - len(raw.lstrip(self._marker))
                missing = markers - (len(text) - len(text.lstrip(" ")))
                if markers and missing > 0:
                    text = " " * missing + text
            self._pieces[token_id] = text
        return text

    def names(self, ids: Sequence[int], context: Sequence[int]) -> list[str]:
        """The strings of ``ids``, alternatives at one position after the sampled ``context``
        (``LogprobsProcessor._verify_tokens``)."""
        out = [self.piece(t) for t in ids]
        for i, text in enumerate(out):
            if text.endswith(_REPLACEMENT):
                out[i] = self._corrected(ids[i], context)
        return out

    def _decode(self, ids: list[int]) -> str:
        try:
            return str(self._tok.decode(ids, skip_special_tokens=False) or "")
        except (OverflowError, TypeError):
            return ""

    def _corrected(self, token_id: int, context: Sequence[int]) -> str:
        """``LogprobsProcessor._correct_decoded_token``: the token's text after its context."""
        context = list(context[-_CONTEXT:])
        for num in range(1, len(context) + 1):
            ctx = context[-num:]
            full = self._decode([*ctx, token_id])
            if full.endswith(_REPLACEMENT):
                continue
            clean_end = len(ctx)
            for j in range(len(ctx) - 1, -1, -1):
                if self._decode([ctx[j]]).endswith(_REPLACEMENT):
                    clean_end = j
                else:
                    break
            prefix = self._decode(ctx[:clean_end]) if clean_end > 0 else ""
            if full.startswith(prefix):
                return full[len(prefix) :]
            common = 0
            for a, b in zip(prefix, full, strict=False):
                if a != b:
                    break
                common += 1
            return full[common:]
        return ""


def _floor(value: float) -> float:
    return max(float(value), MIN_LOGPROB)


PromptEntry = dict[int, tuple[float, int, str]]
"""One prompt position as vLLM's ``dict[int, Logprob]``: id -> (logprob, rank, decoded_token)."""


def prompt_entries(
    names: TokenNames, prompt: Sequence[int], scores: PromptLogprobs
) -> list[PromptEntry | None]:
    """vLLM's ``RequestOutput.prompt_logprobs`` of ``prompt`` (``LogprobsProcessor``).

    Raises ValueError when ``scores`` do not fit the prompt (a broken worker).
    """
    if not scores.consistent(len(prompt)):
        raise ValueError(f"backend sent prompt logprobs that do not fit {len(prompt)} tokens")
    k = scores.top_k
    out: list[PromptEntry | None] = [None]
    context: list[int] = []  # the preceding scored prompt tokens (vLLM's context)
    for i, tid in enumerate(prompt[1:]):
        ids = [tid, *scores.top_ids[i * k : (i + 1) * k]]
        values = [scores.logprobs[i], *scores.top_logprobs[i * k : (i + 1) * k]]
        ranks = [scores.ranks[i], *range(1, k + 1)]
        decoded = names.names(ids, context)
        entry: PromptEntry = {}
        for t, v, r, d in zip(ids, values, ranks, decoded, strict=True):
            entry[t] = (v, r, d)  # a repeated id keeps its place, takes the later entry
        out.append(entry)
        context = [*context[-(_CONTEXT - 1) :], tid]
    return out


def prompt_logprobs_json(entries: Sequence[PromptEntry | None]) -> list[Any]:
    """The ``prompt_logprobs`` field vLLM's server writes (``clamp_prompt_logprobs`` applied)."""
    return [
        None
        if entry is None
        else {
            str(t): {"logprob": _floor(v), "rank": r, "decoded_token": d}
            for t, (v, r, d) in entry.items()
        }
        for entry in entries
    ]


class ChoiceLogprobs:
    """One choice's logprobs: :meth:`take` renders a batch's, :meth:`result` the whole.

    ``chat``: the chat shape, ``top`` = ``top_logprobs``; else the completion
    shape, ``top`` = ``logprobs``. The engine is asked for ``top`` per token.
    ``keep``: remember the parts for :meth:`result` (not streaming).
    ``as_ids``: each token shown as ``token_id:N`` (vLLM's
    ``return_tokens_as_token_ids``; a chat entry's ``bytes`` stay its text's,
    a top entry's are the placeholder's, a completion's text offsets advance
    by the placeholder's length, as vLLM 0.32 writes them).
    """

    __slots__ = ("_as_ids", "_chat", "_context", "_keep", "_names", "_offset", "_parts", "_top")

    def __init__(
        self, names: TokenNames, chat: bool, top: int, keep: bool = True, as_ids: bool = False
    ) -> None:
        self._names = names
        self._as_ids = as_ids
        self._chat = chat
        self._top = top
        self._keep = keep  # for result(); a stream sends each part and forgets it
        self._context: list[int] = []  # the last sampled ids, for partial characters
        self._offset = 0  # text_offset of the next token
        self._parts: list[dict[str, Any]] = []

    def take(
        self,
        token_ids: Sequence[int],
        logprobs: Sequence[float] | None,
        top_ids: Sequence[int] | None,
        top_logprobs: Sequence[float] | None,
        count: int | None = None,
    ) -> dict[str, Any]:
        """The logprobs object of the first ``count`` (default: all) of a batch's tokens.

        Raises ValueError when the arrays do not fit the tokens (a broken worker).
        """
        n = len(token_ids)
        top_ids = top_ids or []
        top_logprobs = top_logprobs or []
        k = len(top_ids) // n if n else 0
        if logprobs is None or len(logprobs) != n or len(top_ids) != n * k:
            raise ValueError(f"backend sent logprobs that do not fit {n} tokens")
        if len(top_logprobs) != len(top_ids):
            raise ValueError("backend sent top logprobs that do not fit their tokens")
        used = n if count is None else min(count, n)
        out = _chat_part() if self._chat else _completion_part()
        for i in range(used):
            tid = token_ids[i]
            entries: dict[int, float] = {tid: logprobs[i]}
            for j in range(i * k, (i + 1) * k):
                entries[top_ids[j]] = top_logprobs[j]
            ids = list(entries)
            names = self._names.names(ids, self._context)
            if self._chat:
                out["content"].append(self._chat_entry(names, ids, entries))
            else:
                self._completion_entry(out, self._shown(names, ids), ids, entries)
            self._context = [*self._context[-(_CONTEXT - 1) :], tid]
        if self._keep:
            self._parts.append(out)
        return out

    def take_prompt(
        self, prompt: Sequence[int], entries: Sequence[PromptEntry | None]
    ) -> dict[str, Any]:
        """The completion logprobs of an echoed prompt (before its generated tokens').

        As vLLM's ``_create_completion_logprobs`` over ``prompt_logprobs``: a
        position without logprobs (the first) is its token decoded alone,
        with ``null`` logprob and top map.
        """
        out = _completion_part()
        for tid, entry in zip(prompt, entries, strict=True):
            if entry is None:
                token = _placeholder(tid) if self._as_ids else self._names._decode([tid])
                out["text_offset"].append(self._offset)
                self._offset += len(token)
                out["token_logprobs"].append(None)
                out["tokens"].append(token)
                out["top_logprobs"].append(None)
                continue
            ids = list(entry)  # the prompt token first (prompt_entries puts it there)
            names = self._shown([entry[t][2] for t in ids], ids)
            self._completion_entry(out, names, ids, {t: entry[t][0] for t in ids})
        if self._keep:
            self._parts.append(out)
        return out

    def _chat_entry(
        self, names: list[str], ids: list[int], entries: dict[int, float]
    ) -> dict[str, Any]:
        shown = self._shown(names, ids)
        return {
            "token": shown[0],
            "logprob": _floor(entries[ids[0]]),
            "bytes": list(names[0].encode("utf-8", errors="replace")),
            "top_logprobs": [
                {
                    "token": name,
                    "logprob": _floor(entries[tid]),
                    "bytes": list(name.encode("utf-8", errors="replace")),
                }
                for name, tid in zip(shown[: self._top], ids, strict=False)
            ],
        }

    def _shown(self, names: list[str], ids: list[int]) -> list[str]:
        """The tokens as the response shows them: their text, or ``token_id:N``."""
        return [_placeholder(t) for t in ids] if self._as_ids else names

    def _completion_entry(
        self, out: dict[str, Any], names: list[str], ids: list[int], entries: dict[int, float]
    ) -> None:
        token = names[0]
        out["text_offset"].append(self._offset)
        self._offset += len(token)
        out["token_logprobs"].append(_floor(entries[ids[0]]))
        out["tokens"].append(token)
        top: dict[str, float] = {}
        for name, tid in zip(names[: self._top + 1], ids, strict=False):
            top[name] = _floor(entries[tid])
        out["top_logprobs"].append(top)

    def result(self) -> dict[str, Any]:
        """Every batch's logprobs as one object (the non-streamed response's)."""
        whole = _chat_part() if self._chat else _completion_part()
        for part in self._parts:
            for key, values in part.items():
                whole[key].extend(values)
        return whole


def drop_first(part: dict[str, Any], count: int) -> tuple[dict[str, Any] | None, int]:
    """``part`` (from :meth:`ChoiceLogprobs.take`) without its first ``count`` tokens' entries.

    Returns the rest (None when nothing is left) and how many of ``count``
    are still to drop in later parts: a resumed stream skips the logprobs
    its client already has (``proxy.resume``).
    """
    held = len(next(iter(part.values()), []))
    dropped = min(count, held)
    if dropped == held:
        return None, count - dropped
    return {key: values[dropped:] for key, values in part.items()}, count - dropped


def _placeholder(token_id: int) -> str:
    """vLLM's ``format_token_id_placeholder``."""
    return f"token_id:{token_id}"


def _chat_part() -> dict[str, Any]:
    return {"content": []}


def _completion_part() -> dict[str, Any]:
    return {"text_offset": [], "token_logprobs": [], "tokens": [], "top_logprobs": []}
