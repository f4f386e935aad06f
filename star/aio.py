"""Asyncio helpers every role shares: deadlines that never lose a cancel."""

from __future__ import annotations

import asyncio


def deadline(delay: float | None) -> asyncio.Timeout:
    """``async with deadline(s):`` ends the block with ``TimeoutError`` after ``s`` seconds.

    STAR's one way to bound an await; ``asyncio.wait_for`` is never used. On
    Python 3.11, ``wait_for`` returns the inner result when a cancel lands
    after the inner await finished but before ``wait_for`` resumed (CPython
    gh-86296, fixed in 3.12): the ``CancelledError`` is lost, so a loop that
    waits this way ignores ``cancel()`` and whoever awaits its task (a
    shutdown) hangs. ``asyncio.timeout`` counts the cancel on the task and
    re-raises it. ``None`` waits without a limit; ``reschedule()`` on the
    returned context moves the deadline. redis-py still calls ``wait_for``
    inside every command; :func:`raise_swallowed_cancel` covers that.
    """
    return asyncio.timeout(delay)


def raise_swallowed_cancel(task: asyncio.Task[object] | None, cancels: int) -> None:
    """Re-raise a cancel of ``task`` that a ``wait_for`` inside a library lost.

    The bug is the one :func:`deadline` describes. The task still counts the
    request (``Task.cancelling()``), so a count above ``cancels`` (the count
    when the awaited call started) is a cancel that was lost on the way.
    """
    if task is not None and task.cancelling() > cancels:
        raise asyncio.CancelledError("cancelled during an await that swallowed it (gh-86296)")
