"""Report builders shared by the scheduler tests (what a worker would publish)."""

from __future__ import annotations

import time

from star.wire import Report, RequestLoad


def report(
    instance: str,
    loads: list[int],
    seq: int = 1,
    capacity: int = 100_000,
    role: str = "decode",
    remaining: float | None = 5_000.0,
    in_flight: list[str] | None = None,
    draining: bool = False,
) -> Report:
    return Report(
        instance=instance,
        role=role,
        seq=seq,
        ts=time.time(),
        address=f"127.0.0.1:{10_000 + abs(hash(instance)) % 1000}",
        capacity_tokens=capacity,
        used_tokens=sum(loads),
        bytes_per_token=1024,
        step_time_s=0.02,
        delta=32,
        trace=[],
        requests=[
            RequestLoad(f"{instance}-r{i}", n, n // 2, remaining) for i, n in enumerate(loads)
        ],
        in_flight=in_flight or [],
        draining=draining,
    )
