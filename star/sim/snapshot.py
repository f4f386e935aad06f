"""The cluster at one scheduler tick, vectorised, and the planner's input built from it.

Paper Algorithm 1, line 4: "Collect worker states". In the live system every
decode worker reports its running requests (N, R-hat, generated) and its own
pre-simulated trace L(tau_0..tau_H); the scheduler books migrations in flight
on their target (``scheduler/view.py``) and hands :func:`star.planner.plan`
one :class:`~star.planner.Instance` per worker. :class:`Snapshot` produces the
same from the simulator's state: flat per-request arrays first (numpy, for
the traces and the gate), planner objects only when the planner is called.
"""

from __future__ import annotations

import itertools
from array import array
from dataclasses import dataclass, replace
from functools import cached_property
from types import ModuleType
from typing import Protocol

import numpy as np
import numpy.typing as npt

from star.planner import Instance, Mode, ModeKind, Request
from star.planner.arrays import ClusterArrays, remaining_of
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

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]
BoolArray = npt.NDArray[np.bool_]

PREDICTING = (ModeKind.PREDICTED, ModeKind.BINS)


def _kernels() -> ModuleType:
    # numba takes ~0.5-1 s to import: imported by runs, not by ``import star.sim``.
    from star.sim import kernels

    return kernels


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

    # Per decode instance (typed arrays: read through np.frombuffer).
    @property
    def S(self) -> array[int]: ...
    @property
    def t0(self) -> array[float]: ...
    @property
    def k(self) -> array[int]: ...
    @property
    def tbsum(self) -> array[int]: ...
    @property
    def extra(self) -> array[float]: ...
    @property
    def mnext(self) -> array[int]: ...
    @property
    def inflight(self) -> array[int]: ...
    @property
    def running(self) -> list[list[int]]: ...
    @property
    def incoming(self) -> list[list[int]]: ...
    @property
    def inst_ids(self) -> list[str]: ...
    @property
    def cap_array(self) -> FloatArray: ...
    @property
    def bpt_array(self) -> FloatArray: ...
    @property
    def all_instances(self) -> BoolArray: ...
    # Per request.
    @property
    def tbase(self) -> IntArray: ...
    @property
    def gbase(self) -> IntArray: ...
    @property
    def output(self) -> IntArray: ...
    @property
    def held(self) -> list[int]: ...
    @property
    def gen_held(self) -> list[int]: ...
    @property
    def pred_held(self) -> list[float | None]: ...
    @property
    def where(self) -> list[int]: ...
    @property
    def ids(self) -> list[str]: ...
    # The run.
    @property
    def n(self) -> int: ...
    @property
    def a(self) -> float: ...
    @property
    def b(self) -> float: ...
    @property
    def cap(self) -> int: ...
    @property
    def bpt(self) -> int: ...
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
        # Copies: the instance arrays keep changing during the tick.
        batch = np.frombuffer(sim.k, dtype=np.int64).copy()
        self.steps, self.loads = _kernels().read_instances(
            now,
            np.frombuffer(sim.t0, dtype=np.float64),
            np.frombuffer(sim.S, dtype=np.int64),
            batch,
            np.frombuffer(sim.tbsum, dtype=np.int64),
            np.frombuffer(sim.extra, dtype=np.float64),
            np.frombuffer(sim.mnext, dtype=np.int64),
            sim.a,
            sim.b,
        )
        self.batch = batch
        self.offsets: IntArray = np.zeros(sim.n + 1, dtype=np.int64)
        np.cumsum(batch, out=self.offsets[1:])

    @cached_property
    def running(self) -> Rows:
        """The running requests of every instance, instance by instance."""
        sim = self.sim
        total = int(self.offsets[-1])
        idx: IntArray = np.fromiter(itertools.chain.from_iterable(sim.running), np.int64, total)
        owner, tokens, generated, true = _kernels().running_rows(
            idx, self.batch, self.steps, sim.tbase, sim.gbase, sim.output
        )
        return Rows(idx, owner, tokens, generated, true)

    @cached_property
    def incoming(self) -> Rows:
        """Requests migrating in, booked on their target (as ``scheduler/view.py`` does)."""
        sim = self.sim
        b_idx = [r for rs in sim.incoming for r in rs]
        idx = np.array(b_idx, dtype=np.int64)
        generated = np.array([sim.gen_held[r] for r in b_idx], dtype=np.int64)
        return Rows(
            idx,
            np.array([sim.where[r] for r in b_idx], dtype=np.int64),
            np.array([sim.held[r] for r in b_idx], dtype=np.float64),
            generated,
            sim.output[idx] - generated,
            np.array(
                [np.nan if sim.pred_held[r] is None else sim.pred_held[r] for r in b_idx],
                dtype=np.float64,
            ),
        )

    @cached_property
    def booked(self) -> FloatArray:
        """Tokens booked on each instance by migrations in flight."""
        if not any(self.sim.incoming):
            return np.zeros(self.sim.n)
        rows = self.incoming
        out = np.bincount(rows.owner, weights=rows.tokens, minlength=self.sim.n)
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
        points, moved = _kernels().prediction_points(
            rows.idx, rows.generated, sim.cfg.predict_every, noise.at
        )
        out: FloatArray = _kernels().predict(
            rows.idx,
            rows.generated,
            points,
            noise.draw(moved),
            noise.z,
            noise.at,
            sim.output,
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
        """:class:`ClusterArrays` of the cluster and the request index of each row.

        Per instance, requests migrating in come first (booked on their
        target, not eligible), then the running ones, as :meth:`instances`
        orders them.
        """
        sim = self.sim
        run = self.running
        n = sim.n
        pred = self.predicted if sim.mode.kind in PREDICTING else np.full(run.idx.size, np.nan)
        idx, tokens, true = run.idx, run.tokens, run.true_remaining
        eligible = np.ones(idx.size, dtype=np.bool_)
        offsets = self.offsets
        if any(sim.incoming):
            inc = self.incoming
            owner = np.concatenate((inc.owner, run.owner))
            # Stable: within an instance, booked rows stay ahead of running ones.
            order = np.argsort(owner, kind="stable")
            idx = np.concatenate((inc.idx, idx))[order]
            tokens = np.concatenate((inc.tokens, tokens))[order]
            true = np.concatenate((inc.true_remaining, true))[order]
            assert inc.predicted is not None
            pred = np.concatenate((inc.predicted, pred))[order]
            eligible = np.concatenate((np.zeros(inc.idx.size, dtype=np.bool_), eligible))[order]
            offsets = np.zeros(n + 1, dtype=np.int64)
            np.cumsum(np.bincount(owner, minlength=n), out=offsets[1:])
        out = ClusterArrays(
            offsets=offsets.astype(np.intp),
            tokens=tokens,
            predicted=pred,
            true_remaining=true.astype(np.float64),
            eligible=eligible,
            capacity=sim.cap_array,
            bytes_per_token=sim.bpt_array,
            step_time_s=sim.a + sim.b * self.loads,
            in_flight=np.frombuffer(sim.inflight, dtype=np.int64) > 0,
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
        out = np.empty((sim.n, sim.tau.size))
        kernels.fill_traces(arrays.offsets, arrays.tokens, k, sim.tau, sim.all_instances, out)
        return out

    def arrays(self, *, with_traces: bool = False) -> tuple[ClusterArrays, IntArray]:
        """The planner's input as arrays, and the request index of each row.

        With ``with_traces`` each instance carries :attr:`traces` as its
        worker's pre-simulated trace (``predicted`` mode uses it).
        """
        arrays, idx = self.planner_input
        if with_traces:
            arrays = replace(arrays, traces=self.traces, has_trace=self.sim.all_instances)
        return arrays, idx

    def instances(self, *, with_traces: bool = False) -> list[Instance]:
        """The planner's input: every decode instance with its running requests.

        Requests migrating in come first, busy and not migratable. With
        ``with_traces`` each instance carries :attr:`traces` as its worker's
        pre-simulated trace, which the planner uses in ``predicted`` mode
        instead of recomputing it.
        """
        sim = self.sim
        ids = sim.ids
        run = self.running
        if sim.mode.kind in PREDICTING or sim.cfg.dispatch == "predicted":
            pred: list[float | None] = self.predicted.tolist()
        else:
            pred = [None] * run.idx.size
        reqs = tuple(
            map(
                Request,
                [ids[r] for r in run.idx.tolist()],
                run.tokens.astype(np.int64).tolist(),
                pred,
                run.true_remaining.tolist(),
                run.generated.tolist(),
            )
        )
        offsets = self.offsets.tolist()
        step = (sim.a + sim.b * self.loads).tolist()
        rows: list[tuple[float, ...] | None] = (
            [tuple(row) for row in self.traces.tolist()] if with_traces else [None] * sim.n
        )
        none: frozenset[str] = frozenset()
        out: list[Instance] = []
        for i in range(sim.n):
            mine = reqs[offsets[i] : offsets[i + 1]]
            busy = none
            if sim.incoming[i]:
                booked = tuple(self._booked(r) for r in sim.incoming[i])
                mine = booked + mine
                busy = frozenset(b.id for b in booked)
            out.append(
                Instance(
                    sim.inst_ids[i],
                    mine,
                    sim.cap,
                    sim.bpt,
                    step[i],
                    sim.inflight[i] > 0,
                    busy,
                    rows[i],
                )
            )
        return out

    def _booked(self, r: int) -> Request:
        sim = self.sim
        gen = sim.gen_held[r]
        rem = int(sim.output[r]) - gen
        return Request(sim.ids[r], sim.held[r], sim.pred_held[r], rem, gen, migratable=False)
