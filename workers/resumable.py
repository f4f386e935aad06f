"""Requests a proxy may take over: what a worker keeps of them, and its orphans.

A request opened with :class:`~star.wire.ResumableGenerate` keeps a
:class:`Record` for its whole life: its prompt, every token it has generated
(a continuation's earlier tokens included), its end, and the proxy's opaque
context. When the connection of the proxy that runs it goes away, the worker
holds it as an orphan (:class:`Orphans`) for ``worker.orphan_grace_s``:
still decoding, its tokens recorded, then aborted (its KV freed) unless a
proxy has attached it (:class:`~star.wire.Attach`) meanwhile. A finished
orphan is kept as long, for a proxy to collect its end.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec

from star.wire import Attached, Generate, ResumableGenerate
from workers.protocol import PromptScores, TokenDelta


@dataclass(slots=True)
class Record:
    """What an :class:`~star.wire.Attached` says of one request."""

    request_id: str
    prompt: list[int]
    outputs: list[int]
    context: bytes
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    released: bool = False  # its KV went to a migration's target (no token follows here)
    # A request with logprobs: those of outputs[scored_from:] (the tokens
    # generated here), as LogprobTokens carries them; None: none asked for.
    logprobs: list[float] | None = None
    top_ids: list[int] = field(default_factory=list)
    top_logprobs: list[float] = field(default_factory=list)
    scored_from: int = 0
    prompt_scores: PromptScores | None = None  # computed here (this worker prefilled it)

    @classmethod
    def of(cls, msg: Generate) -> Record | None:
        """The record of a Generate (None: not resumable)."""
        if not isinstance(msg, ResumableGenerate):
            return None
        # A continuation's prompt ends with the tokens generated before it.
        cut = len(msg.prompt_token_ids) - msg.continued
        prompt = list(msg.prompt_token_ids[:cut])
        outputs = list(msg.prompt_token_ids[cut:])
        scored: list[float] | None = [] if msg.sampling.get("logprobs") is not None else None
        return cls(
            msg.request_id, prompt, outputs, msg.context, logprobs=scored, scored_from=len(outputs)
        )

    def add(self, delta: TokenDelta) -> None:
        if delta.prompt is not None:
            self.prompt_scores = delta.prompt
        self.outputs.extend(delta.token_ids)
        if self.logprobs is not None and delta.token_ids:
            if delta.logprobs is None:  # cannot happen with a request that asked for them
                raise ValueError(f"request {self.request_id}: tokens came without logprobs")
            self.logprobs.extend(delta.logprobs)
            self.top_ids.extend(delta.top_ids)
            self.top_logprobs.extend(delta.top_logprobs)
        if delta.finish_reason is not None:
            self.finish_reason = delta.finish_reason
            self.stop_reason = delta.stop_reason

    @property
    def ended(self) -> bool:
        return self.finish_reason is not None or self.released

    def attached(self, stream: int) -> Attached:
        return Attached(
            stream=stream,
            request_id=self.request_id,
            prompt_token_ids=self.prompt,
            output_token_ids=list(self.outputs),
            context=self.context,
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
            released=self.released,
            logprobs=None if self.logprobs is None else list(self.logprobs),
            top_ids=list(self.top_ids),
            top_logprobs=list(self.top_logprobs),
            scored_from=self.scored_from,
            prompt=msgspec.UNSET if self.prompt_scores is None else self.prompt_scores.to_frame(0),
        )


@dataclass
class Orphans:
    """Requests whose proxy went away, by request id, each until its grace runs out.

    ``expire(request_id)`` is called when it does (the server aborts the
    request if it still runs). Time is the event loop's.
    """

    grace_s: float
    expire: Callable[[str], None]
    _timers: dict[str, asyncio.TimerHandle] = field(default_factory=dict)

    def hold(self, request_id: str) -> None:
        self.release(request_id)
        loop = asyncio.get_running_loop()
        self._timers[request_id] = loop.call_later(self.grace_s, self._expired, request_id)

    def release(self, request_id: str) -> bool:
        """Stop holding ``request_id`` (attached, or gone); False if it was not held."""
        timer = self._timers.pop(request_id, None)
        if timer is None:
            return False
        timer.cancel()
        return True

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._timers

    def __len__(self) -> int:
        return len(self._timers)

    def _expired(self, request_id: str) -> None:
        if self._timers.pop(request_id, None) is not None:
            self.expire(request_id)

    def clear(self) -> list[str]:
        """Stop every timer; the ids that were held."""
        ids = list(self._timers)
        for request_id in ids:
            self.release(request_id)
        return ids
