"""Taking over a stream another proxy ran: find its worker, Attach, decode on from there.

A resume that names a stream this proxy does not hold (its proxy was killed
or restarted, or the client came back through another one) asks the decode
worker that holds the request (the one whose report lists it, else each live
decode worker) to hand it over (:class:`~star.wire.Attach`). The answer
(:class:`~star.wire.Attached`) has the prompt, every token so far, the end if
the request has ended, and the context the first proxy put in its
``ResumableGenerate`` (:func:`proxy.resume.context_of`), from which this proxy
rebuilds the response. The request then runs on as any of this proxy's
(:class:`~proxy.decode_run.DecodeRun`: migrations and recoveries included). A
request whose KV was released for a migration that never completed is
continued by recompute on a decode instance the dispatch policy picks.
"""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any, Protocol

import structlog

from proxy.backend import BackendError, GenerationRequest, TokenBatch
from proxy.decode_run import DecodeRun, Fleet, Found
from proxy.upstream import ConnectionLost
from star.aio import deadline
from star.sampling import migration_blocker
from star.wire import Abort, Attach, Attached

log = structlog.get_logger(__name__)

ATTACH_TIMEOUT_S = 5.0
FINISHED = ("stop", "length", "abort")


class Pool(Protocol):
    """Connections to workers by address (:class:`proxy.upstream.WorkerPool`)."""

    async def get(self, address: str) -> Any: ...


class Owner(Fleet, Protocol):
    """What a taken-over run needs of its backend (:class:`proxy.cluster.ClusterBackend`)."""

    async def pick_decode(self, prompt_tokens: int) -> Any: ...

    def run_decode(
        self,
        req: GenerationRequest,
        run: DecodeRun,
        instance: str,
        begin: Callable[[], Awaitable[None]],
    ) -> AsyncIterator[TokenBatch]: ...


async def attach(pool: Pool, members: Sequence[tuple[str, str]], request_id: str) -> Found | None:
    """Ask the decode workers ``members`` ((instance, address), in order) for ``request_id``.

    A worker that still runs it wins over one that released it for a
    migration (the target, if the move got that far, holds the later tokens).
    """
    released: Found | None = None
    asked: dict[str, str] = {}  # instance -> what it said (the log of a miss)
    for instance, address in members:
        try:
            client = await pool.get(address)
        except (OSError, ConnectionLost, TimeoutError) as exc:
            asked[instance] = f"unreachable: {type(exc).__name__}"
            continue
        leg = client.open()
        try:
            await leg.send(Attach(stream=leg.id, request_id=request_id))
            async with deadline(ATTACH_TIMEOUT_S):
                msg = await leg.next()
        except (ConnectionLost, TimeoutError) as exc:
            leg.close()
            asked[instance] = f"no answer: {type(exc).__name__}"
            continue
        if not isinstance(msg, Attached):
            leg.close()  # unknown_request: not there
            asked[instance] = "not held"
            continue
        found = Found(msg, instance, address, leg)
        if msg.released and msg.finish_reason is None:
            released = released or found
            continue
        if released is not None:
            released.leg.close()
        return _adopted(found)
    if released is None:
        log.info("stream_not_held", request_id=request_id, asked=asked)
        return None
    return _adopted(released)


async def abandon(found: Found) -> None:
    """Give up a request taken over (no client can have its rest): it is aborted on
    its worker, its KV freed, and its leg closed."""
    try:
        await found.leg.send(Abort(found.leg.id))
    except ConnectionLost:
        pass  # the worker is gone; it frees the KV when it notices
    finally:
        found.leg.close()


def _adopted(found: Found) -> Found:
    done = found.attached
    log.info(
        "stream_adopted",
        request_id=done.request_id,
        instance=found.instance,
        tokens=len(done.output_token_ids),
        finish_reason=done.finish_reason,
        released=done.released,
    )
    return found


async def serve(backend: Owner, req: GenerationRequest, found: Found) -> AsyncIterator[TokenBatch]:
    """The request's tokens after those in ``found.attached`` (none if it has ended)."""
    done = found.attached
    if done.finish_reason is not None:
        found.leg.close()
        if done.finish_reason not in FINISHED:
            raise BackendError(
                f"the request ended on {found.instance} with {done.finish_reason!r}",
                code="engine_error",
            )
        return
    sampling = dict(req.sampling)
    sampling.pop("n", None)
    blocker = None if req.migratable else migration_blocker(sampling) or "not migratable"
    run = DecodeRun(backend, req, sampling, blocker)
    begin: Callable[[], Awaitable[None]]
    if done.released:  # its KV left for a target that never took it: recompute elsewhere
        found.leg.close()
        run.machine.generated.extend(done.output_token_ids)
        member = await backend.pick_decode(len(req.prompt_token_ids) + len(done.output_token_ids))
        begin = functools.partial(run.start, member.instance, member.address, None)
        instance = member.instance
    else:

        async def adopt() -> None:
            run.adopt(found.instance, found.address, found.leg, done.output_token_ids)

        begin, instance = adopt, found.instance
    async for batch in backend.run_decode(req, run, instance, begin):
        yield batch
