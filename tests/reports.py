"""One builder of :class:`star.wire.Report` for tests (what a worker would publish)."""

from __future__ import annotations

import time

from star.wire import Report, RequestLoad


def report(
    instance: str = "decode-0",
    *,
    role: str = "decode",
    address: str = "127.0.0.1:1",
    used: int = 0,
    capacity: int = 10_000,
    seq: int = 1,
    delta: int = 32,
    trace: list[float] | None = None,
    requests: list[RequestLoad] | None = None,
) -> Report:
    """A fresh report of ``instance``; its load trace is flat at ``used`` unless given.

    The default address is a port nothing listens on (port 1): fine for a
    directory, dispatch or a refusal, not for a request that reaches it.
    """
    return Report(
        instance=instance,
        role=role,
        seq=seq,
        ts=time.time(),
        address=address,
        capacity_tokens=capacity,
        used_tokens=used,
        bytes_per_token=512,
        step_time_s=0.01,
        delta=delta,
        trace=[float(used)] if trace is None else trace,
        requests=requests or [],
    )
