"""The base of every long-running STAR process (uvicorn's ``Server`` shape).

A :class:`Service` subclass implements :meth:`Service.startup`,
:meth:`Service.main` (runs until asked to stop), :meth:`Service.drain`
(stop intake, finish in-flight work) and :meth:`Service.cleanup` (close
connections). :meth:`Service.run` is what a CLI command calls: it installs
uvloop, runs :meth:`Service.serve`, and returns the exit status.

Signals only set flags: the first SIGINT/SIGTERM asks for a graceful stop
(drain with ``drain_timeout_s``), a second one forces it (remaining work is
cancelled with a message). systemd is told ``READY=1`` after startup,
``STOPPING=1`` when the stop begins, and ``WATCHDOG=1`` at half the
watchdog interval when ``WATCHDOG_USEC`` is set.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
import signal
import socket
import time
from collections.abc import Coroutine, Mapping
from typing import Any

import structlog

from star.aio import deadline

log = structlog.get_logger(__name__)


def sd_notify(state: str, env: Mapping[str, str] | None = None) -> bool:
    """Send ``state`` (e.g. ``READY=1``) to systemd's ``$NOTIFY_SOCKET``.

    Returns False when not running under a notify-type unit. An abstract
    socket address starts with ``@``.
    """
    env = os.environ if env is None else env
    path = env.get("NOTIFY_SOCKET")
    if not path:
        return False
    address = "\0" + path[1:] if path.startswith("@") else path
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
            sock.connect(address)
            sock.sendall(state.encode())
    except OSError as exc:
        log.warning("sd_notify_failed", state=state, error=str(exc))
        return False
    return True


def freeze_heap() -> int:
    """Move every object alive now into the collector's permanent generation.

    Called once start-up is done (vLLM's engine core does the same). A worker
    imports torch, transformers and vLLM's front end: some 700,000 objects,
    which a full collection walks in 0.2-0.5 s on this 2-core machine. Every
    full collection after start-up would stall the event loop relaying
    tokens for that long; frozen, those objects are no longer walked. Returns
    the number of objects frozen.
    """
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def set_gc_gen0_threshold(threshold: int) -> tuple[int, int, int]:
    """Set the collector's young-generation threshold (0 = leave it); returns
    the thresholds now in force.

    A young collection runs every ``threshold`` container allocations net of
    frees. A process that keeps a large, fast-turning set of small objects
    alive (the scheduler's view: ~64 requests per instance, replaced with each
    report) pays for many short collections and for the full ones their
    promotions trigger; a higher threshold trades that CPU for the memory of
    cyclic garbage that waits longer. The older generations' thresholds stay.
    """
    if threshold:
        _, gen1, gen2 = gc.get_threshold()
        gc.set_threshold(threshold, gen1, gen2)
    return gc.get_threshold()


class SafePointCollector:
    """The garbage collector at the caller's safe points only.

    The interpreter collects whenever an allocation crosses a threshold,
    wherever the program is: in the scheduler that was in the middle of a
    tick (a young collection of ~50,000 objects took 45-240 ms on this
    2-core machine under load). Constructed, it turns automatic collection
    off; :meth:`collect_due` then runs the collection the interpreter would
    have run by now (the oldest generation whose count passed its
    threshold), so the cost is the same and only its moment moves: the
    scheduler calls it right after each tick, when the next one is furthest
    away. Counting goes on while automatic collection is off.
    """

    def __init__(self) -> None:
        self.thresholds = gc.get_threshold()
        gc.disable()

    def collect_due(self) -> int | None:
        """Collect the oldest generation that is due; returns it, or None."""
        counts = gc.get_count()
        for generation in (2, 1, 0):
            if self.thresholds[generation] and counts[generation] > self.thresholds[generation]:
                gc.collect(generation)
                return generation
        return None

    def close(self) -> None:
        """Automatic collection back on."""
        gc.enable()


def watchdog_interval(env: Mapping[str, str] | None = None) -> float | None:
    """Half the systemd watchdog interval in seconds, if one is configured for us."""
    env = os.environ if env is None else env
    usec = env.get("WATCHDOG_USEC")
    pid = env.get("WATCHDOG_PID")
    if not usec or (pid and pid != str(os.getpid())):
        return None
    try:
        return max(int(usec) / 2e6, 0.01)
    except ValueError:
        return None


class Service:
    """A long-running process: override the four hooks, call :meth:`run`."""

    name = "service"

    def __init__(self, drain_timeout_s: float = 30.0) -> None:
        self.drain_timeout_s = drain_timeout_s
        self.force_exit = False
        self.started = False
        self._exit: asyncio.Event | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self._signals = 0
        self._phase: asyncio.Task[Any] | None = None  # main() or drain(), whichever runs
        self.failed: BaseException | None = None

    # -- hooks -------------------------------------------------------------------

    async def startup(self) -> None:
        """Open connections, bind sockets. Raise to abort the start."""

    async def main(self) -> None:
        """The work; the default waits until a stop is requested."""
        await self.wait_exit()

    async def drain(self) -> None:
        """Stop intake and let in-flight work finish (bounded by ``drain_timeout_s``)."""

    async def cleanup(self) -> None:
        """Close what :meth:`startup` opened; runs even after a failed start."""

    # -- plumbing -------------------------------------------------------------------

    async def _drain_within(self) -> None:
        """:meth:`drain`, ended by ``TimeoutError`` after ``drain_timeout_s``."""
        async with deadline(self.drain_timeout_s):
            await self.drain()

    @property
    def exiting(self) -> bool:
        return self._exit is not None and self._exit.is_set()

    def request_exit(self) -> None:
        """Ask for a graceful stop (safe to call from signal handlers and tests)."""
        if self._exit is not None:
            self._exit.set()

    async def wait_exit(self) -> None:
        assert self._exit is not None, "serve() not running"
        await self._exit.wait()

    def spawn(self, coro: Coroutine[Any, Any, Any], name: str) -> asyncio.Task[Any]:
        """Start an owned background task; its failure stops the service."""
        task = asyncio.create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)
        return task

    def _task_done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if task.cancelled():
            return
        exc = task.exception()
        if exc is not None:
            log.error(
                "task_failed_stopping",
                task=task.get_name(),
                error=repr(exc),
                exc_info=exc,
            )
            self.failed = exc
            self.request_exit()

    def _on_signal(self, signum: int) -> None:
        self._signals += 1
        if self._signals == 1:
            log.info(
                "stop_requested_draining",
                signal=signal.Signals(signum).name,
                timeout_s=self.drain_timeout_s,
            )
            self.request_exit()
        else:
            log.warning("second_signal_forcing_exit", signal=signal.Signals(signum).name)
            self.force_exit = True
            self.request_exit()
            if self._phase is not None:
                self._phase.cancel("forced exit")

    def install_signal_handlers(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.add_signal_handler(sig, self._on_signal, sig)

    def remove_signal_handlers(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.remove_signal_handler(sig)

    async def _watchdog(self, interval: float) -> None:
        while True:
            sd_notify("WATCHDOG=1")
            await asyncio.sleep(interval)

    async def serve(self, install_signals: bool = True) -> int:
        """Start, run until stopped, drain, clean up; returns the exit status."""
        self._exit = asyncio.Event()
        if install_signals:
            self.install_signal_handlers()
        status = 0
        try:
            try:
                await self.startup()
            except Exception as exc:
                # One line the operator acts on (the cause, the setting to change);
                # the traceback only at debug level.
                log.error("startup_failed", service=self.name, error=str(exc) or repr(exc))
                log.debug("startup_failed_traceback", service=self.name, exc_info=exc)
                return 1
            self.started = True
            log.debug("heap_frozen", service=self.name, objects=freeze_heap())
            sd_notify("READY=1")
            interval = watchdog_interval()
            if interval:
                self.spawn(self._watchdog(interval), "watchdog")
            log.info("started", service=self.name)
            self._phase = asyncio.create_task(self.main(), name=f"{self.name}.main")
            try:
                await self._phase
            except asyncio.CancelledError:
                if not self.force_exit:
                    raise
            except Exception as exc:
                log.error("service_failed", service=self.name, error=str(exc), exc_info=exc)
                status = 1
            if self.failed is not None:
                status = 1
            sd_notify("STOPPING=1")
            started = time.monotonic()
            if not self.force_exit:
                self._phase = asyncio.create_task(self._drain_within(), name=f"{self.name}.drain")
                try:
                    await self._phase
                except TimeoutError:
                    log.warning("drain_timed_out", timeout_s=self.drain_timeout_s)
                except asyncio.CancelledError:
                    if not self.force_exit:
                        raise
            for task in list(self._tasks):
                task.cancel(f"{self.name} shutting down")
            if self._tasks:
                await asyncio.gather(*self._tasks, return_exceptions=True)
            log.info(
                "stopped",
                service=self.name,
                drain_s=round(time.monotonic() - started, 3),
                status=status,
            )
            return status
        finally:
            with contextlib.suppress(Exception):
                await self.cleanup()
            if install_signals:
                self.remove_signal_handlers()

    def run(self) -> int:
        """Entry point for a CLI command: uvloop, serve, exit status."""
        try:
            import uvloop

            return uvloop.run(self.serve())
        except ImportError:  # pragma: no cover - uvloop is a core dependency
            return asyncio.run(self.serve())
