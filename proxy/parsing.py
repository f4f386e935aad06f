"""Parsing generation requests off the proxy's event loop.

A request's parse (JSON, validation, the chat template, tokenising) is CPU
work in proportion to its size: on the event loop a 4 MB prompt held every
open stream for seconds (issue 27 item 4). :class:`Parsing` parses a body of
up to ``inline_bytes`` inline, where that is cheaper than a hand-off, and a
larger one in a worker process of one process-wide pool of
:data:`PARSE_WORKERS`: that bounds how many run at once (the rest queue in
order), and the loop only ships the body out and takes the parsed request
back (its prompt, at most the model's context, as token ids).

Why processes, not threads: ``Tokenizer.encode`` holds the GIL throughout;
``encode_batch`` releases it while tokenising, but building the ids list and
freeing the ``Encoding`` of a million-token prompt are single GIL-held calls
of 60-220 ms, and json and jinja2 hold the GIL too: measured in a thread, the
4 MB prompt still stretched another stream's gaps from 25 ms to 120 ms, and
50,000 chat messages to 600 ms (docs/operations.md, "Parsing off the loop").
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import pickle
import signal
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass

import structlog

from proxy.backend import GenerationRequest
from proxy.http import HttpError
from proxy.openai import ParsedRequest, TextOptions
from proxy.tokenizer import ModelCard

log = structlog.get_logger()

Parser = Callable[[bytes, dict[str, ModelCard]], ParsedRequest]

# Bodies up to this size are parsed on the loop (at most about 2.5 ms there);
# a hand-off to a worker costs this process 0.3-0.5 ms of CPU and adds about
# 0.5 ms of latency (docs/operations.md, "Parsing off the loop").
INLINE_BODY_BYTES = 4 * 1024
# Worker processes that parse larger bodies, at most this many at once.
PARSE_WORKERS = 2
# Their CPU priority below the proxy's own (nice increment).
WORKER_NICE = 10
# Model sets a worker keeps loaded (one per ProxyApp; tests make many).
_WORKER_MODEL_SETS = 8


@dataclass(frozen=True, slots=True)
class _Refused:
    """An HttpError from a worker (exceptions with keyword-only fields do not pickle)."""

    status: int
    message: str
    type: str
    param: str | None
    code: str | int | None


class Parsing:
    """Parses one app's generation requests: small bodies inline, large ones in a worker."""

    def __init__(self, models: dict[str, ModelCard], inline_bytes: int = INLINE_BODY_BYTES) -> None:
        self.models = models
        self.inline_bytes = inline_bytes
        self._shipped: bytes | None = None  # the models as a worker loads them

    async def parse(self, parse: Parser, body: bytes) -> ParsedRequest:
        """``parse(body, models)``, off the loop when the body is large."""
        if len(body) <= self.inline_bytes:
            return parse(body, self.models)
        if self._shipped is None:
            # A loaded card pickles as its tokenizer's path (ModelCard.__reduce__).
            self._shipped = pickle.dumps(list(self.models.values()))
        pool = _pool()
        try:
            result = await asyncio.get_running_loop().run_in_executor(
                pool, _parse_in_worker, parse, body, self._shipped
            )
        except BrokenProcessPool:
            _discard(pool)
            log.warning("parse_worker_died", body_bytes=len(body))
            raise HttpError(
                503, "the request could not be parsed now; retry later", code="parser_unavailable"
            ) from None
        if isinstance(result, _Refused):
            raise HttpError(
                result.status,
                result.message,
                type=result.type,
                param=result.param,
                code=result.code,
            )
        gen, text, prompts, echo = result
        return ParsedRequest(gen, text, self.models[gen.model], prompts, echo)


# -- the process-wide pool ------------------------------------------------------------

_lock = threading.Lock()
_executor: ProcessPoolExecutor | None = None


def _pool() -> ProcessPoolExecutor:
    global _executor
    with _lock:
        if _executor is None:
            # spawn, not fork: the proxy has threads (and tokenizers a thread pool).
            _executor = ProcessPoolExecutor(
                PARSE_WORKERS,
                mp_context=multiprocessing.get_context("spawn"),
                initializer=_init_worker,
            )
        return _executor


def _discard(pool: ProcessPoolExecutor) -> None:
    """Drop a broken pool; the next large request starts a new one."""
    global _executor
    with _lock:
        if _executor is pool:
            _executor = None
    pool.shutdown(wait=False, cancel_futures=True)


def shutdown() -> None:
    """Stop the worker processes (they also stop when this process exits)."""
    global _executor
    with _lock:
        pool, _executor = _executor, None
    if pool is not None:
        pool.shutdown(wait=True, cancel_futures=True)


# -- in the worker ----------------------------------------------------------------------

_loaded: dict[bytes, dict[str, ModelCard]] = {}


def _init_worker() -> None:
    # Ctrl-C reaches the whole process group: the proxy decides, not its workers.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # Where cores are short, the relay (every open stream) goes first; a large
    # parse takes what is left.
    os.nice(WORKER_NICE)
    # A worker holds both ends of its task queue, so it sees no EOF when the
    # proxy is killed outright: it watches for being orphaned instead.
    parent = os.getppid()
    threading.Thread(target=_exit_when_orphaned, args=(parent,), daemon=True).start()


def _exit_when_orphaned(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(1.0)
    os._exit(0)


def _parse_in_worker(
    parse: Parser, body: bytes, shipped: bytes
) -> tuple[GenerationRequest, TextOptions, tuple[list[int], ...], tuple[str, ...]] | _Refused:
    models = _loaded.get(shipped)
    if models is None:
        if len(_loaded) >= _WORKER_MODEL_SETS:
            _loaded.pop(next(iter(_loaded)))
        cards: list[ModelCard] = pickle.loads(shipped)
        models = _loaded[shipped] = {card.name: card for card in cards}
    try:
        parsed = parse(body, models)
    except HttpError as exc:
        return _Refused(exc.status, exc.message, exc.type, exc.param, exc.code)
    return parsed.gen, parsed.text, parsed.prompts, parsed.echo  # the card stays here


def start() -> list[Future[int]]:
    """Start the worker processes now, not on the first large request.

    Starting a process forks this one, which holds the GIL for tens of
    milliseconds: ``star proxy`` does it before it listens. The futures are
    done when the workers are up.
    """
    pool = _pool()
    return [pool.submit(int) for _ in range(PARSE_WORKERS)]  # none idle: each starts one
