"""An engine-core process ends once the worker that started it is gone.

vLLM's engine core outlived a worker that was SIGKILLed (by an operator, the
OOM killer, a ``star up`` killed outright): an orphan holding its memory, KV
cache and ports. Standard library only: this module is loaded from vLLM's
logging configuration, while ``vllm.logger`` itself is being imported.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time

_watch: threading.Thread | None = None


def end_with_parent(
    interval_s: float = 1.0, grace_s: float = 15.0, parent: int | None = None
) -> threading.Thread:
    """End this process (SIGTERM, then exit after ``grace_s``) once ``parent`` is gone.

    ``parent`` defaults to the parent now; a process already reparented away
    from ``parent`` ends at once. Checked every ``interval_s``; vLLM's own
    SIGTERM handler then shuts the engine down. One watch per process: a
    second call returns the first one's thread.
    """
    global _watch
    if _watch is not None:
        return _watch
    parent = os.getppid() if parent is None else parent

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(interval_s)
        print(
            f"star: the engine's parent process {parent} is gone; shutting the engine down",
            file=sys.stderr,
            flush=True,
        )
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(grace_s)
        os._exit(1)

    _watch = threading.Thread(target=watch, name="star-parent-watch", daemon=True)
    _watch.start()
    return _watch


class ParentWatch(logging.NullHandler):
    """A logging handler that logs nothing and starts :func:`end_with_parent`.

    vLLM applies its logging configuration (``VLLM_LOGGING_CONFIG_PATH``, see
    :mod:`workers.startup`) first thing in a new engine-core process, a minute
    before the model and the KV cache are up and ``StarScheduler`` starts
    its own watch: the earliest STAR code runs there. A worker killed during
    that minute left its engine core behind for good.
    """

    def __init__(self, parent: int) -> None:
        super().__init__()
        if os.getppid() != parent and _alive(parent):
            return  # a process the engine core started (vLLM's own workers watch theirs)
        end_with_parent(parent=parent)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
