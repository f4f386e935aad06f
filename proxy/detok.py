"""Incremental detokenisation and stop strings, sans-IO.

Token ids arrive a few at a time (possibly from different engines after a
migration); the client must see text that, concatenated, equals decoding all
ids at once, with no UTF-8 character split across two SSE chunks. The
``tokenizers`` library's :class:`~tokenizers.decoders.DecodeStream` does the
hard part (it holds back ids whose bytes do not yet form whole characters);
this module adds the end-of-stream flush it lacks, stop-string matching with
hold-back of a possible partial match, and the per-choice bookkeeping.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import structlog
from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

log = structlog.get_logger()

REPLACEMENT = "\ufffd"
# vLLM's FastIncrementalDetokenizer primes the stream with a prompt suffix of
# between 4 and 24 tokens that decodes cleanly; we follow it so a first token
# like SentencePiece's "▁word" keeps its leading space.
_MIN_PRIME, _MAX_PRIME = 4, 24


class IncrementalDetokenizer:
    """Turns a stream of token ids into text chunks that never split a character."""

    __slots__ = ("_added", "_context", "_last_added", "_pending", "_skip", "_stream", "_tok")

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: Sequence[int] = (),
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
    ) -> None:
        self._tok = tokenizer
        self._skip = skip_special_tokens
        prime = _prompt_suffix(tokenizer, prompt_token_ids, skip_special_tokens)
        self._stream = DecodeStream(ids=prime or None, skip_special_tokens=skip_special_tokens)
        self._context: list[int] = prime  # ids behind the last emitted text
        self._pending: list[int] = []  # ids fed since the last emitted text
        # vLLM's FastIncrementalDetokenizer without spaces between special tokens
        # (which only matters while they are shown): an added token right after
        # another is its raw content, whatever the decoder puts before it.
        self._added: dict[int, str] | None = None
        if not skip_special_tokens and not spaces_between_special_tokens:
            added = {t: a.content for t, a in tokenizer.get_added_tokens_decoder().items()}
            self._added = added or None
        self._last_added = False

    def step(self, token_ids: Sequence[int]) -> str:
        """Feed new ids; return the text they complete ("" while a character is partial)."""
        if self._added is None:
            return self._step(token_ids)
        out = []
        for tid in token_ids:  # one at a time, as vLLM's decode_next
            text = self._step((tid,))
            content = self._added.get(tid)
            if content is not None and self._last_added:
                text = content
            self._last_added = content is not None
            out.append(text)
        return "".join(out)

    def _step(self, token_ids: Sequence[int]) -> str:
        if not token_ids:
            return ""
        ids = list(token_ids)
        try:
            text = self._stream.step(self._tok, ids if len(ids) > 1 else ids[0])
        except Exception as exc:  # tokenizers raises a plain Exception on an invalid prefix
            text = self._recover(ids, exc)
        if text is None:
            self._pending.extend(ids)
            return ""
        self._context = self._pending + ids
        self._pending = []
        return str(text)

    def flush(self) -> str:
        """The text of ids still held back at the end of the stream (may contain U+FFFD)."""
        pending = self._pending
        if not pending:
            return ""
        base = self._tok.decode(self._context, skip_special_tokens=self._skip)
        full = self._tok.decode(self._context + pending, skip_special_tokens=self._skip)
        self._context, self._pending = self._context + pending, []
        if full.startswith(base):
            return str(full[len(base) :])
        return str(self._tok.decode(pending, skip_special_tokens=self._skip))

    def _recover(self, ids: list[int], exc: Exception) -> str | None:
        # Some decoders are not prefix-stable on invalid UTF-8 and DecodeStream
        # then refuses ("Invalid prefix"); like vLLM, restart the stream from
        # the held-back ids rather than fail the request.
        log.warning("detok_reset", error=str(exc))
        self._stream = DecodeStream(skip_special_tokens=self._skip)
        held, self._pending = self._pending, []
        try:
            text = self._stream.step(self._tok, held + ids)
        except (OverflowError, TypeError):  # an id outside the vocabulary
            return None
        if text is None:
            self._pending = held
        return None if text is None else str(text)


def _prompt_suffix(tok: Tokenizer, prompt: Sequence[int], skip: bool) -> list[int]:
    if len(prompt) <= _MIN_PRIME:
        suffix = list(prompt)
        return suffix if REPLACEMENT not in tok.decode(suffix, skip_special_tokens=skip) else []
    for n in range(_MIN_PRIME, min(len(prompt), _MAX_PRIME) + 1):
        suffix = list(prompt[-n:])
        if REPLACEMENT not in tok.decode(suffix, skip_special_tokens=skip):
            return suffix
    # No clean suffix (a prompt of raw bytes): priming with a partial character
    # would leak prompt text into the output, so start cold.
    return []


class StopMatcher:
    """Finds stop strings in streamed text, holding back what might start one.

    Text that could be the beginning of a stop string is not released until
    the next chunk shows whether it is; at the end of the stream the hold-back
    is released by :meth:`flush`.
    """

    __slots__ = ("_held", "_include", "_stops")

    def __init__(self, stops: Sequence[str], include_in_output: bool = False) -> None:
        self._stops = tuple(s for s in stops if s)
        self._include = include_in_output
        self._held = ""

    def feed(self, text: str, check: bool = True) -> tuple[str, str | None]:
        """Return ``(text to release, matched stop string or None)``.

        After a match the released text ends at the match (or after it, with
        ``include_in_output``) and the caller stops the stream. ``check=False``
        releases everything (vLLM ignores stop strings before ``min_tokens``).
        """
        if not self._stops:
            return text, None
        buf = self._held + text
        self._held = ""
        if not check:
            return buf, None
        # The match that completes first wins (then the longer one), as if the
        # text had arrived one character at a time: chunking must not matter.
        best: tuple[int, int, str] | None = None
        for stop in self._stops:
            at = buf.find(stop)
            if at >= 0 and (best is None or (at + len(stop), at) < best[:2]):
                best = (at + len(stop), at, stop)
        if best is not None:
            end, at, stop = best
            return buf[:end] if self._include else buf[:at], stop
        keep = self._partial(buf)
        if keep:
            self._held = buf[-keep:]
            return buf[:-keep], None
        return buf, None

    def flush(self) -> str:
        """Release the held-back text (the stream ended without a match)."""
        held, self._held = self._held, ""
        return held

    def _partial(self, buf: str) -> int:
        """Length of the longest suffix of ``buf`` that is a proper prefix of a stop."""
        best = 0
        for stop in self._stops:
            for k in range(min(len(stop) - 1, len(buf)), best, -1):
                if buf.endswith(stop[:k]):
                    best = k
                    break
        return best


class TextStream:
    """One choice's text: detokeniser + stop strings + token count + finish state."""

    __slots__ = (
        "_detok",
        "_include",
        "_min_tokens",
        "_stop",
        "cut",
        "finish_reason",
        "num_tokens",
        "stop_reason",
    )

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: Sequence[int] = (),
        stop: Sequence[str] = (),
        include_stop_str_in_output: bool = False,
        skip_special_tokens: bool = True,
        min_tokens: int = 0,
        spaces_between_special_tokens: bool = True,
    ) -> None:
        self._detok = IncrementalDetokenizer(
            tokenizer, prompt_token_ids, skip_special_tokens, spaces_between_special_tokens
        )
        self._stop = StopMatcher(stop, include_stop_str_in_output) if any(stop) else None
        self._min_tokens = min_tokens
        self._include = include_stop_str_in_output
        self.num_tokens = 0
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None
        self.cut = False  # finished here (a stop string), not by the backend

    @property
    def finished(self) -> bool:
        """True once a finish reason is known (from the backend or a stop string)."""
        return self.finish_reason is not None

    def feed(self, token_ids: Sequence[int], stop_terminated: bool = False) -> str:
        """Consume new ids; return the text to send now.

        A stop-string match sets ``finish_reason = "stop"``; ids after the one
        that completed the match are ignored (and not counted).
        ``stop_terminated``: the backend ends the choice with these ids on a
        stop (EOS or a stop token id); as vLLM's detokenizer does
        (``BaseIncrementalDetokenizer.update``), the last id's text is left
        out, and out of the stop-string check, unless
        ``include_stop_str_in_output``; it is still counted.
        """
        if self.finish_reason is not None:
            return ""
        if stop_terminated and token_ids and not self._include:
            text = self.feed(token_ids[:-1])
            if self.finish_reason is None:
                self.num_tokens += 1
            return text
        if self._stop is None:
            self.num_tokens += len(token_ids)
            return self._detok.step(token_ids)
        # Token by token, so the count stops exactly at the token that matched.
        parts: list[str] = []
        for tid in token_ids:
            self.num_tokens += 1
            text, matched = self._stop.feed(
                self._detok.step((tid,)), check=self.num_tokens > self._min_tokens
            )
            parts.append(text)
            if matched is not None:
                self.finish_reason, self.stop_reason, self.cut = "stop", matched, True
                break
        return "".join(parts)

    def finish(self, reason: str, stop_reason: Any = None) -> str:
        """The backend ended this choice; return the last of the text."""
        if self.finish_reason is not None:
            return ""
        tail = self._detok.flush()
        if self._stop is not None:
            text, matched = self._stop.feed(tail, check=self.num_tokens > self._min_tokens)
            if matched is not None:
                self.finish_reason, self.stop_reason, self.cut = "stop", matched, True
                return text
            tail = text + self._stop.flush()
        self.finish_reason = reason
        self.stop_reason = stop_reason
        return tail
