"""The simulator's state, struct of arrays: the decode fleet and the requests.

One array per quantity, one entry per decode instance (:class:`FleetState`)
or per request (:class:`RequestState`). The event handlers read and write
single entries, so those arrays are typed arrays (``array.array``) or lists,
several times faster per element than numpy; the vectorised tick reads the
typed arrays through :func:`numpy_view` (no copy) and hands the numba
kernels arrays, never these objects.

An instance's batch is fixed between two of its events, so its state is
kept at an iteration boundary: ``steps`` iterations done at time ``at``. A
running request's token count is ``tokens_base + steps`` of its instance
(and its generated count ``generated_base + steps``), so an instance's token
load is ``tokens_base_sum + batch x steps``.
"""

from __future__ import annotations

from array import array
from collections import deque
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]
BoolArray = npt.NDArray[np.bool_]


def numpy_view(typed: array[Any]) -> npt.NDArray[Any]:
    """A numpy array over a typed array's memory (``q``: int64, ``d``: float64)."""
    return np.frombuffer(typed, dtype=np.int64 if typed.typecode == "q" else np.float64)


def _ints(n: int) -> array[int]:
    return array("q", bytes(8 * n))


def _floats(n: int) -> array[float]:
    return array("d", bytes(8 * n))


_TYPED = (
    "steps",
    "at",
    "batch",
    "tokens_base_sum",
    "reserved",
    "extra_s",
    "steps_to_event",
    "first_finish",
    "version",
)


@dataclass(slots=True)
class FleetState:
    """Every decode instance, one entry each."""

    ids: list[str]
    index: dict[str, int]  # id -> instance
    capacity: FloatArray  # KV capacity in tokens (the planner's input)
    bytes_per_token: FloatArray
    everyone: BoolArray  # all True: every instance reports a trace
    steps: array[int]  # iterations done up to ``at``
    at: array[float]  # time of the iteration boundary the state is at
    batch: array[int]  # running requests
    tokens_base_sum: array[int]  # sum of tokens_base over the running requests
    reserved: array[int]  # KV held for migrations in or out
    extra_s: array[float]  # one-off cost of the next iteration (recompute)
    steps_to_event: array[int]  # iterations to the next internal event (0: idle)
    first_finish: array[int]  # smallest finish_step over the running requests
    version: array[int]  # invalidates stale WAKE events
    running: list[array[int]]  # requests in the batch, in admission order (typed: the
    # tick joins the buffers into one array instead of iterating every request)
    waiting: list[deque[int]]  # admitted FIFO when they fit
    incoming: list[list[int]]  # requests migrating in (booked here), in start order
    views: dict[str, npt.NDArray[Any]]  # numpy_view of each typed array, by field name

    @classmethod
    def empty(cls, n: int, capacity_tokens: int, bytes_per_token: int) -> FleetState:
        """``n`` idle instances at time 0."""
        ids = [f"d{i}" for i in range(n)]
        fleet = cls(
            ids=ids,
            index={iid: i for i, iid in enumerate(ids)},
            capacity=np.full(n, float(capacity_tokens)),
            bytes_per_token=np.full(n, float(bytes_per_token)),
            everyone=np.ones(n, dtype=np.bool_),
            steps=_ints(n),
            at=_floats(n),
            batch=_ints(n),
            tokens_base_sum=_ints(n),
            reserved=_ints(n),
            extra_s=_floats(n),
            steps_to_event=_ints(n),
            first_finish=_ints(n),
            version=_ints(n),
            running=[array("q") for _ in range(n)],
            waiting=[deque() for _ in range(n)],
            incoming=[[] for _ in range(n)],
            views={},
        )
        for name in _TYPED:
            fleet.views[name] = numpy_view(getattr(fleet, name))
        return fleet

    @property
    def size(self) -> int:
        """Number of decode instances."""
        return len(self.ids)


@dataclass(slots=True)
class RequestState:
    """Every request of the run, one entry each (arrived or not)."""

    ids: list[str]
    arrival: FloatArray  # seconds
    prompt: IntArray  # tokens
    output: IntArray  # tokens to generate, the first by prefill
    ttft_s: FloatArray  # NaN until the first token
    finish: FloatArray  # time of the last token, NaN until then
    tokens_base: IntArray  # tokens = tokens_base + its instance's steps, while running
    generated_base: IntArray  # generated = generated_base + its instance's steps
    held_tokens: list[int]  # tokens in KV while not in a batch
    held_generated: list[int]  # generated tokens while not in a batch
    finish_step: list[int]  # its instance's steps at which it finishes
    instance: list[int]  # decode instance (the target while migrating), -1: none
    source: list[int]  # the instance it migrates from while in flight, -1: none
    recompute: list[bool]  # preempted: its KV is recomputed when readmitted
    held_prediction: list[float | None]  # R-hat the planner moved it with, while in flight
    preemptions: IntArray
    migrations: IntArray

    @classmethod
    def new(cls, arrival: FloatArray, prompt: IntArray, output: IntArray) -> RequestState:
        """Requests that have not arrived yet."""
        n = arrival.size
        return cls(
            ids=[str(i) for i in range(n)],
            arrival=arrival,
            prompt=prompt,
            output=output,
            ttft_s=np.full(n, np.nan),
            finish=np.full(n, np.nan),
            tokens_base=np.zeros(n, dtype=np.int64),
            generated_base=np.zeros(n, dtype=np.int64),
            held_tokens=[0] * n,
            held_generated=[0] * n,
            finish_step=[0] * n,
            instance=[-1] * n,
            source=[-1] * n,
            recompute=[False] * n,
            held_prediction=[None] * n,
            preemptions=np.zeros(n, dtype=np.int64),
            migrations=np.zeros(n, dtype=np.int64),
        )

    @property
    def size(self) -> int:
        """Number of requests."""
        return len(self.ids)
