"""A worker killed with SIGKILL takes its vLLM engine-core process with it.

vLLM starts the engine core as a child process; when the worker died without
unwinding (SIGKILL, the OOM killer), the engine core lived on as an orphan
holding its memory and ports. ``workers.parent.end_with_parent`` ends it.
The worker here is a real ``EngineHandle`` on the tiny model in a process of
its own, killed the way the OOM killer would.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap

import psutil

from tests.procs import sigkill, wait_gone

HOLDER = textwrap.dedent(
    """
    import asyncio, os, sys, time
    import psutil
    from star.model import tiny_model_path
    from workers.engine import EngineHandle
    from workers.engine_config import EngineSpec

    async def main():
        spec = EngineSpec(model=str(tiny_model_path()), kv_cache_space_gib=0.125,
                          engine_args={"enforce_eager": True})
        engine = await EngineHandle.start(spec)
        cores = [p.pid for p in psutil.Process().children(recursive=True)
                 if "EngineCor" in p.name()]
        print("CORES", *cores, flush=True)
        while True:
            await asyncio.sleep(1)

    if __name__ == "__main__":
        asyncio.run(main())
    """
)


def test_engine_core_ends_when_its_worker_is_killed() -> None:
    worker = subprocess.Popen(
        [sys.executable, "-c", HOLDER],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env={**os.environ, "PYTHONPATH": os.getcwd()},
        start_new_session=True,
    )
    cores: list[int] = []
    try:
        assert worker.stdout is not None
        for line in worker.stdout:  # vLLM logs to stdout too
            if line.startswith("CORES"):
                cores = [int(p) for p in line.split()[1:]]
                break
        assert cores, "the worker found no engine-core process"
        worker.send_signal(signal.SIGKILL)
        worker.wait(timeout=10)
        alive = wait_gone(lambda: [p for p in cores if _running(p)])
        assert not alive, f"engine core(s) {alive} outlived their worker by 30 s"
    finally:
        worker.kill()
        sigkill(cores)


def _running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


WATCHED = textwrap.dedent(
    """
    import sys, time
    from workers.parent import ParentWatch

    ParentWatch(parent=int(sys.argv[1]))
    print("watching", flush=True)
    time.sleep(30)
    """
)


def _watched(parent: int, started: bool = True) -> subprocess.Popen[str]:
    """A process watching ``parent``; with ``started``, once it says it is watching."""
    proc = subprocess.Popen(
        [sys.executable, "-c", WATCHED, str(parent)],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env={**os.environ, "PYTHONPATH": os.getcwd()},
    )
    assert proc.stdout is not None
    if started:
        assert proc.stdout.readline() == "watching\n"
    return proc


def test_an_engine_core_whose_worker_died_before_it_started_ends_at_once() -> None:
    """The watch starts with vLLM's logging configuration, in the engine core's first moment.

    An engine core that only started watching once loaded (``StarScheduler``)
    took its parent then -- init, already -- and ran on for good.
    """
    gone = subprocess.Popen(["true"])
    gone.wait()
    # Its worker is already gone: the watch may end it before it prints a word.
    proc = _watched(gone.pid, started=False)
    try:
        assert proc.wait(timeout=20) == -signal.SIGTERM
    finally:
        proc.kill()


def test_the_watch_leaves_a_live_parents_engine_core_and_vllms_own_workers_alone() -> None:
    own, other = _watched(os.getpid()), _watched(os.getppid())  # other: a grandparent, alive
    try:
        with contextlib.suppress(subprocess.TimeoutExpired):
            own.wait(timeout=3)
        assert own.poll() is None and other.poll() is None
    finally:
        own.kill()
        other.kill()
        own.wait()
        other.wait()
