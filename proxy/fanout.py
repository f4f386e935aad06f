"""One client request, several upstream requests: ``n > 1`` and batched prompts.

vLLM's server turns a completion with ``P`` prompts and ``n`` choices into
``P x n`` sequences; so does the proxy, one ordinary ``n = 1`` request per
choice, so that each is dispatched, balanced and migrated (if its sampling
allows) on its own. :func:`children` derives them (sans-IO): choice ``k`` is
prompt ``k // n`` and its seed is ``seed + k % n``, the seed vLLM 0.32 gives
that child (``ParentRequest._get_child_sampling_params``). :class:`FanIn`
merges their token streams into one, each batch's ``index`` set to its
choice, for :class:`~proxy.openai.Relay`.

Cancellation follows :mod:`proxy.backend`'s contract for every child:
closing or cancelling the merged stream cancels each child's pump, whose
generator then aborts its request upstream; :meth:`FanIn.drop` does that for
one child (its choice was cut by a stop string). A child that fails fails
the merged stream, and the others are aborted when it is closed.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, replace
from typing import Any

from proxy.backend import GenerationRequest, TokenBatch, is_migratable
from proxy.openai import ParsedRequest, Relay


def child_ids(request_id: str, count: int) -> list[str]:
    """The upstream request ids of a request of ``count`` choices (its own, for one)."""
    return [request_id] if count == 1 else [f"{request_id}-{k}" for k in range(count)]


def children(parsed: ParsedRequest) -> list[GenerationRequest]:
    """The upstream requests of ``parsed``, one per choice, in choice order.

    A request of one prompt and ``n = 1`` is its own only child (unchanged).
    """
    gen = parsed.gen
    n = gen.n
    if n == 1 and len(parsed.batch) == 1:
        return [gen]
    base = {k: v for k, v in gen.sampling.items() if k != "n"}
    seed = base.get("seed")
    out = []
    for k, request_id in enumerate(child_ids(gen.request_id, parsed.num_choices)):
        prompt = parsed.batch[k // n]
        sampling = base if seed is None else {**base, "seed": seed + k % n}
        if parsed.asked_max_tokens:  # the budget the prompt's context leaves (vLLM's clamp)
            room = parsed.card.max_model_len - len(prompt)
            sampling = {**sampling, "max_tokens": min(parsed.asked_max_tokens, room)}
        out.append(
            replace(
                gen,
                request_id=request_id,
                prompt_token_ids=prompt,
                sampling=sampling,
                migratable=is_migratable(sampling),
            )
        )
    return out


@dataclass(frozen=True, slots=True)
class _End:
    index: int
    error: BaseException | None = None


class FanIn:
    """Merges the children's token streams; see the module docstring.

    Each child runs in a pump task that forwards its batches through a queue
    bounded at one slot per child, so a slow client holds every child back as
    it would hold one stream. ``ahead``: batches to yield before any child's
    (a stream taken over from the workers: what they already generated).
    """

    def __init__(
        self, streams: Sequence[AsyncIterator[TokenBatch]], ahead: Sequence[TokenBatch] = ()
    ) -> None:
        self._streams = list(streams)
        self._ahead = collections.deque(ahead)
        self._queue: asyncio.Queue[TokenBatch | _End] = asyncio.Queue(len(self._streams))
        self._pumps: list[asyncio.Task[None]] = []
        self._live = set(range(len(self._streams)))

    def __aiter__(self) -> FanIn:
        return self

    async def __anext__(self) -> TokenBatch:
        if not self._pumps and self._live:
            self._pumps = [
                asyncio.create_task(self._pump(k, s), name=f"fan-in-{k}")
                for k, s in enumerate(self._streams)
            ]
        while self._ahead:
            batch = self._ahead.popleft()
            if batch.index in self._live:
                return batch
        while self._live:
            item = await self._queue.get()
            if isinstance(item, TokenBatch):
                if item.index in self._live:
                    return item
                continue  # a dropped child's last batch
            if item.index not in self._live:
                continue
            self._live.discard(item.index)
            if item.error is not None:
                raise item.error
        raise StopAsyncIteration

    async def drop(self, index: int) -> None:
        """Stop child ``index`` (its request is aborted upstream); the others go on."""
        if index not in self._live:
            return
        self._live.discard(index)
        if self._pumps:
            await _cancel([self._pumps[index]])
        else:
            await _aclose(self._streams[index])

    async def aclose(self) -> None:
        """Stop every child still running (each aborts upstream)."""
        self._live.clear()
        if self._pumps:
            await _cancel(self._pumps)
        else:
            for stream in self._streams:  # never started: nothing upstream yet
                await _aclose(stream)

    async def _pump(self, index: int, stream: AsyncIterator[TokenBatch]) -> None:
        try:
            try:
                async for batch in stream:
                    batch.index = index
                    await self._queue.put(batch)
            except Exception as exc:  # the consumer raises it, in its own task
                await self._queue.put(_End(index, exc))
                return
            await self._queue.put(_End(index))
        finally:
            await _aclose(stream)  # cancelled while queueing: the generator still aborts


async def drop_if_cut(relay: Relay, stream: AsyncIterator[TokenBatch], batch: TokenBatch) -> None:
    """One choice of several cut by a stop string: abort its request, the others go on."""
    if isinstance(stream, FanIn) and relay.choices[batch.index].cut:
        await stream.drop(batch.index)


async def _cancel(tasks: Sequence[asyncio.Task[None]]) -> None:
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


async def _aclose(stream: AsyncIterator[Any]) -> None:
    aclose = getattr(stream, "aclose", None)
    if aclose is not None:
        await aclose()
