"""The cluster at one scheduler tick, vectorised, and the planner's input built from it.

Paper Algorithm 1, line 4: "Collect worker states". In the live system every
decode worker reports its running requests (N, R-hat, generated) and its own
pre-simulated trace L(tau_0..tau_H); the scheduler books migrations in flight
on their target (:mod:`star.planner.flight`) and hands :func:`star.planner.plan`
one :class:`~star.planner.Instance` per worker. :class:`Snapshot` produces the
same from the simulator's state: flat per-request arrays first (numpy, for
the traces and the gate), planner objects only when the planner is called.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property, lru_cache
from types import ModuleType
from typing import TYPE_CHECKING, Protocol

import numpy as np
import numpy.typing as npt

from star.planner import Instance, Mode, ModeKind, Request
from star.planner.arrays import ClusterArrays, remaining_of
from star.planner.flight import Booking, book
from star.sim.config import SimConfig
from star.sim.predictor import (
    CORRELATION_TOKENS,
    LAMBDA_TOKENS,
    PRIOR_STEP,
    S0,
    S_MIN,
    W0,
    NoiseState,
    PriorMedian,
)
from star.sim.state import FleetState, RequestState

if TYPE_CHECKING:
    from star.sim.kernels import Tables

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]
BoolArray = npt.NDArray[np.bool_]

PREDICTING = (ModeKind.PREDICTED, ModeKind.BINS)


def _kernels() -> ModuleType:
    # numba takes ~0.5-1 s to import: imported by runs, not by ``import star.sim``.
    from star.sim import kernels

    return kernels


@lru_cache(maxsize=8)
def _tables(prior: PriorMedian, every: int, max_output: int) -> Tables:
    # One run's constant part of every prediction (~1 ms to build).
    return _kernels().prediction_tables(  # type: ignore[no-any-return]
        every, max_output, CORRELATION_TOKENS, prior.table, float(PRIOR_STEP), W0,
        LAMBDA_TOKENS, S0, S_MIN,
    )  # fmt: skip


@dataclass(frozen=True, slots=True)
class Rows:
    """Flat per-request arrays: running requests in instance order, or booked ones."""

    idx: IntArray  # request index
    owner: IntArray  # decode instance
    tokens: FloatArray  # N(r)
    generated: IntArray
    true_remaining: IntArray
    predicted: FloatArray | None = None  # booked rows: the R-hat decided with (NaN: none)


class SimState(Protocol):
    """What a :class:`Snapshot` reads of the simulator (:class:`star.sim.engine.Simulator`).

    A protocol, so that the engine imports this module and not the reverse.
    """

    @property
    def fleet(self) -> FleetState: ...
    @property
    def requests(self) -> RequestState: ...
    @property
    def step_base_s(self) -> float: ...
    @property
    def step_per_token_s(self) -> float: ...
    @property
    def capacity(self) -> int: ...
    @property
    def bytes_per_token(self) -> int: ...
    @property
    def cfg(self) -> SimConfig: ...
    @property
    def mode(self) -> Mode: ...
    @property
    def tau(self) -> FloatArray: ...
    @property
    def noise(self) -> NoiseState: ...
    @property
    def prior(self) -> PriorMedian: ...


class Snapshot:
    """Every decode instance at time ``now``, read-only.

    Instances are mid-iteration at ``now``; each is read at its last
    completed iteration boundary. Per-request arrays, traces and planner
    objects are built on first use (a tick without planning needs only the
    per-instance loads).
    """

    def __init__(self, sim: SimState, now: float) -> None:
        self.sim = sim
        fleet = sim.fleet
        self.size = fleet.size
        view = fleet.views
        # Copies: the instance arrays keep changing during the tick.
        batch = view["batch"].copy()
        self.steps, self.loads = _kernels().read_instances(
            now,
            view["at"],
            view["steps"],
            batch,
            view["tokens_base_sum"],
            view["extra_s"],
            view["steps_to_event"],
            sim.step_base_s,
            sim.step_per_token_s,
        )
        self.batch = batch
        self.offsets: IntArray = np.zeros(self.size + 1, dtype=np.int64)
        np.cumsum(batch, out=self.offsets[1:])

    @cached_property
    def running(self) -> Rows:
        """The running requests of every instance, instance by instance."""
        req = self.sim.requests
        total = int(self.offsets[-1])
        # One copy of the typed per-instance buffers (bytearray: writable, as the
        # kernels are compiled for).
        idx: IntArray = np.frombuffer(bytearray().join(self.sim.fleet.running), np.int64)
        assert idx.size == total
        owner, tokens, generated, true = _kernels().running_rows(
            idx, self.batch, self.steps, req.tokens_base, req.generated_base, req.output
        )
        return Rows(idx, owner, tokens, generated, true)

    @cached_property
    def incoming(self) -> Rows:
        """Requests migrating in, on their target, instance by instance."""
        req = self.sim.requests
        b_idx = [r for rs in self.sim.fleet.incoming for r in rs]
        idx = np.array(b_idx, dtype=np.int64)
        generated = np.array([req.held_generated[r] for r in b_idx], dtype=np.int64)
        held = req.held_prediction
        return Rows(
            idx,
            np.array([req.instance[r] for r in b_idx], dtype=np.int64),
            np.array([req.held_tokens[r] for r in b_idx], dtype=np.float64),
            generated,
            req.output[idx] - generated,
            np.array([np.nan if held[r] is None else held[r] for r in b_idx], dtype=np.float64),
        )

    @cached_property
    def booking(self) -> Booking:
        """The running rows with the migrations in flight booked on their targets
        (:func:`star.planner.flight.book`, the live scheduler's rule)."""
        run = self.running
        if not any(self.sim.fleet.incoming):
            none = np.zeros(0, dtype=np.int64)
            flags = none.astype(np.bool_)
            return book(
                self.size, run.owner, run.idx, none, none, none, flags, offsets=self.offsets
            )
        inc = self.incoming
        source = self.sim.requests.source
        return book(
            self.size,
            run.owner,
            run.idx,
            inc.idx,
            np.array([source[r] for r in inc.idx.tolist()], dtype=np.int64),
            inc.owner,
            np.ones(inc.idx.size, dtype=np.bool_),
            offsets=self.offsets,
        )

    @property
    def in_flight(self) -> BoolArray:
        """Instances taking part in a migration."""
        return self.booking.in_flight

    @cached_property
    def booked(self) -> FloatArray:
        """Tokens booked on each instance by migrations in flight."""
        if not any(self.sim.fleet.incoming):
            return np.zeros(self.size)
        rows = self.incoming
        out = np.bincount(rows.owner, weights=rows.tokens, minlength=self.size)
        return out.astype(np.float64)

    @cached_property
    def predicted(self) -> FloatArray:
        """R-hat of each running request from its last prediction (every k steps),
        minus the tokens generated since."""
        sim = self.sim
        rows = self.running
        if sim.cfg.predictor == "oracle":
            return rows.true_remaining.astype(np.float64)
        noise = sim.noise
        every = sim.cfg.predict_every
        points, moved = _kernels().prediction_points(rows.idx, rows.generated, every, noise.at)
        out: FloatArray = _kernels().predict_tabled(
            rows.idx,
            rows.generated,
            points,
            noise.draw(moved),
            noise.z,
            noise.at,
            sim.requests.output,
            every,
            *_tables(sim.prior, every, sim.cfg.max_output_tokens),
            CORRELATION_TOKENS,
            sim.prior.table,
            float(PRIOR_STEP),
            W0,
            LAMBDA_TOKENS,
            S0,
            S_MIN,
            float(sim.cfg.max_output_tokens),
        )
        return out

    @cached_property
    def planner_input(self) -> tuple[ClusterArrays, IntArray]:
        """:class:`ClusterArrays` of the cluster and the request index of each row,
        ordered by :attr:`booking` (per instance, requests migrating in first)."""
        sim = self.sim
        run = self.running
        booking = self.booking
        pred = self.predicted if sim.mode.kind in PREDICTING else np.full(run.idx.size, np.nan)
        idx, tokens, true = run.idx, run.tokens, run.true_remaining
        eligible = ~booking.booked
        if booking.booked.any():
            inc = self.incoming
            assert inc.predicted is not None
            rows = booking.rows
            idx = np.concatenate((idx, inc.idx))[rows]
            tokens = np.concatenate((tokens, inc.tokens))[rows]
            true = np.concatenate((true, inc.true_remaining))[rows]
            pred = np.concatenate((pred, inc.predicted))[rows]
        waste = sim.cfg.planned_waste_tokens
        if waste:  # block-aware planning: traces, c_r and C_mig all see the block footprint
            tokens = tokens + waste
        out = ClusterArrays(
            offsets=booking.offsets.astype(np.intp),
            tokens=tokens,
            predicted=pred,
            true_remaining=true.astype(np.float64),
            eligible=eligible,
            capacity=sim.fleet.capacity,
            bytes_per_token=sim.fleet.bytes_per_token,
            step_time_s=sim.step_base_s + sim.step_per_token_s * self.loads,
            in_flight=booking.in_flight,
        )
        return out, idx

    @cached_property
    def traces(self) -> FloatArray:
        """L_i(tau_j) for every instance, as workers pre-simulate it (paper §5.2).

        The planner's own R-hat rule and trace kernels
        (:func:`star.planner.arrays.remaining_of`,
        :func:`star.planner.kernels.fill_traces`) over the rows of
        :attr:`planner_input`: requests migrating in are booked on their target.
        """
        from star.planner import kernels

        sim = self.sim
        arrays = self.planner_input[0]
        k = kernels.cutoffs(remaining_of(arrays, sim.mode), sim.tau)
        out = np.empty((self.size, sim.tau.size))
        kernels.fill_traces(arrays.offsets, arrays.tokens, k, sim.tau, sim.fleet.everyone, out)
        return out

    def arrays(self, *, with_traces: bool = False) -> tuple[ClusterArrays, IntArray]:
        """The planner's input as arrays, and the request index of each row.

        With ``with_traces`` each instance carries :attr:`traces` as its
        worker's pre-simulated trace (``predicted`` mode uses it).
        """
        a, idx = self.planner_input
        if with_traces:  # dataclasses.replace, spelt out: it costs ~3x as much per tick
            a = ClusterArrays(
                offsets=a.offsets,
                tokens=a.tokens,
                predicted=a.predicted,
                true_remaining=a.true_remaining,
                eligible=a.eligible,
                capacity=a.capacity,
                bytes_per_token=a.bytes_per_token,
                step_time_s=a.step_time_s,
                in_flight=a.in_flight,
                traces=self.traces,
                has_trace=self.sim.fleet.everyone,
                draining=a.draining,
            )
        return a, idx

    def instances(self, *, with_traces: bool = False) -> list[Instance]:
        """The planner's input: every decode instance with its running requests.

        Requests migrating in come first, busy and not migratable. With
        ``with_traces`` each instance carries :attr:`traces` as its worker's
        pre-simulated trace, which the planner uses in ``predicted`` mode
        instead of recomputing it.
        """
        sim = self.sim
        ids = sim.requests.ids
        run = self.running
        if sim.mode.kind in PREDICTING or sim.cfg.dispatch == "predicted":
            pred: list[float | None] = self.predicted.tolist()
        else:
            pred = [None] * run.idx.size
        reqs = list(
            map(
                Request,
                [ids[r] for r in run.idx.tolist()],
                run.tokens.astype(np.int64).tolist(),
                pred,
                run.true_remaining.tolist(),
                run.generated.tolist(),
            )
        )
        booking = self.booking
        if booking.booked.any():
            reqs += [self._booked(r) for r in self.incoming.idx.tolist()]
        rows = booking.rows.tolist()
        flags = [False] * run.idx.size + [True] * (len(reqs) - run.idx.size)
        offsets = booking.offsets.tolist()
        step = (sim.step_base_s + sim.step_per_token_s * self.loads).tolist()
        traces: list[tuple[float, ...] | None] = (
            [tuple(row) for row in self.traces.tolist()] if with_traces else [None] * self.size
        )
        in_flight = booking.in_flight.tolist()
        out: list[Instance] = []
        for i, iid in enumerate(sim.fleet.ids):
            lo, hi = offsets[i], offsets[i + 1]
            mine = tuple([reqs[q] for q in rows[lo:hi]])
            busy = frozenset([reqs[q].id for q in rows[lo:hi] if flags[q]])
            out.append(
                Instance(
                    iid,
                    mine,
                    sim.capacity,
                    sim.bytes_per_token,
                    step[i],
                    in_flight[i],
                    busy,
                    traces[i],
                )
            )
        return out

    def _booked(self, r: int) -> Request:
        req = self.sim.requests
        gen = req.held_generated[r]
        rem = int(req.output[r]) - gen
        held = req.held_tokens[r]
        return Request(req.ids[r], held, req.held_prediction[r], rem, gen, migratable=False)
