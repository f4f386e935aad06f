"""What every fuzz test shares: how many inputs, the per-input time limits, the tally.

``STAR_FUZZ_EXAMPLES`` (default 500) is hypothesis' ``max_examples`` per
test; set it higher for a longer run (``STAR_FUZZ_EXAMPLES=50000 pytest
tests/fuzz``). The default keeps the tier near 80 s of the suite's run,
which must stay under CI's 40 minutes (2,000 took 246 s on 2026-11-28). Each input has a hypothesis ``deadline`` (``STAR_FUZZ_DEADLINE_MS``,
default 5,000 ms: generous, this is a shared CI box) and a hard limit
(:func:`hard_limit`) that turns a hang into a failure instead of a stuck run.
Each test prints ``fuzz <name>: N inputs, 0 crashes, 0 hangs`` when it passes
(to stderr, seen with ``pytest -s``, and appended to ``$STAR_FUZZ_REPORT`` if set).

The suite's run is derandomized (the same inputs every time), so a CI run is
reproducible and cannot go red on a draw; ``STAR_FUZZ_RANDOM=1`` explores new
inputs (``STAR_FUZZ_RANDOM=1 STAR_FUZZ_EXAMPLES=20000 pytest tests/fuzz``), and
whatever it finds becomes a named regression test next to the fuzz test.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
from collections.abc import Callable, Iterator
from datetime import timedelta
from types import FrameType
from typing import Any

from hypothesis import HealthCheck, settings

EXAMPLES = int(os.environ.get("STAR_FUZZ_EXAMPLES", "500"))
DEADLINE_MS = int(os.environ.get("STAR_FUZZ_DEADLINE_MS", "5000"))
RANDOM = os.environ.get("STAR_FUZZ_RANDOM", "") == "1"
HANG_S = 30.0  # one input taking this long is a hang, whatever the load

FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=timedelta(milliseconds=DEADLINE_MS),
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    database=None,  # no example database under the shared checkout
    derandomize=not RANDOM,
)


class Hang(Exception):
    """One input ran past :data:`HANG_S`."""


@contextlib.contextmanager
def hard_limit(seconds: float = HANG_S) -> Iterator[None]:
    """Raise :class:`Hang` in the block after ``seconds`` of wall time (SIGALRM)."""

    def expire(_signum: int, _frame: FrameType | None) -> None:
        raise Hang(f"one input ran past {seconds:.0f} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


class Tally:
    """Counts the inputs one fuzz test ran and what they came to."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.inputs = 0
        self.outcomes: dict[str, int] = {}

    def run(self, body: Callable[[], str]) -> None:
        """Run one input under the hard limit; ``body`` names its (expected) outcome."""
        self.inputs += 1
        with hard_limit():
            outcome = body()
        self.outcomes[outcome] = self.outcomes.get(outcome, 0) + 1

    def report(self, minimum: int = 1) -> str:
        assert self.inputs >= minimum, f"{self.name}: only {self.inputs} inputs ran"
        seen = ", ".join(f"{k} {v}" for k, v in sorted(self.outcomes.items()))
        line = f"fuzz {self.name}: {self.inputs} inputs, 0 crashes, 0 hangs ({seen})"
        sys.stderr.write(line + "\n")
        if path := os.environ.get("STAR_FUZZ_REPORT"):
            with open(path, "a") as out:
                out.write(line + "\n")
        return line


def run_fuzz(tally: Tally, test: Callable[..., Any]) -> None:
    """Run a hypothesis test and print its tally (visible with ``pytest -s``)."""
    test()
    tally.report(minimum=min(EXAMPLES, 10))
