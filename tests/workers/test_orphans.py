"""A worker killed with SIGKILL takes its vLLM engine-core process with it.

vLLM starts the engine core as a child process; when the worker died without
unwinding (SIGKILL, the OOM killer), the engine core lived on as an orphan
holding its memory and ports. ``workers.vllm_ext.end_with_parent`` ends it.
The worker here is a real ``EngineHandle`` on the tiny model in a process of
its own, killed the way the OOM killer would.
"""

from __future__ import annotations

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
    from workers.engine import EngineHandle, EngineSpec

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
