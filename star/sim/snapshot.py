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
import math
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt

from star.planner import Instance, ModeKind, Request
from star.planner.trace import bin_value, cutoffs, traces_from_arrays
from star.sim.decode import steps_done
from star.sim.predictor import noisy_estimate, prediction_points

if TYPE_CHECKING:
    from star.sim.engine import Simulator

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]

PREDICTING = (ModeKind.PREDICTED, ModeKind.BINS)


@dataclass(frozen=True, slots=True)
class Rows:
    """Flat per-request arrays: running requests in instance order, or booked ones."""

    idx: IntArray  # request index
    owner: IntArray  # decode instance
    tokens: FloatArray  # N(r)
    generated: IntArray
    true_remaining: IntArray
    predicted: FloatArray | None = None  # booked rows: the R-hat decided with (NaN: none)


class Snapshot:
    """Every decode instance at time ``now``, read-only.

    Instances are mid-iteration at ``now``; each is read at its last
    completed iteration boundary. Per-request arrays, traces and planner
    objects are built on first use (a tick without planning needs only the
    per-instance loads).
    """

    def __init__(self, sim: Simulator, now: float) -> None:
        self.sim = sim
        # Copies: the instance arrays keep changing during the tick.
        batch = np.frombuffer(sim.k, dtype=np.int64).copy()
        steps = np.frombuffer(sim.S, dtype=np.int64)
        base = np.frombuffer(sim.tbsum, dtype=np.int64) + batch * steps
        done = steps_done(
            now - np.frombuffer(sim.t0, dtype=np.float64),
            base.astype(np.float64),
            batch.astype(np.float64),
            sim.a,
            sim.b,
            np.frombuffer(sim.extra, dtype=np.float64),
            np.frombuffer(sim.mnext, dtype=np.int64).astype(np.float64),
        )
        self.steps: IntArray = steps + done
        self.batch = batch
        self.loads: FloatArray = (base + batch * done).astype(np.float64)
        self.offsets: IntArray = np.zeros(sim.n + 1, dtype=np.int64)
        np.cumsum(batch, out=self.offsets[1:])

    @cached_property
    def running(self) -> Rows:
        """The running requests of every instance, instance by instance."""
        sim = self.sim
        total = int(self.offsets[-1])
        idx: IntArray = np.fromiter(itertools.chain.from_iterable(sim.running), np.int64, total)
        owner: IntArray = np.repeat(np.arange(sim.n, dtype=np.int64), self.batch)
        at = self.steps[owner]
        generated = sim.gbase[idx] + at
        return Rows(
            idx,
            owner,
            (sim.tbase[idx] + at).astype(np.float64),
            generated,
            sim.output[idx] - generated,
        )

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
        gen = rows.generated
        at = prediction_points(gen, sim.cfg.predict_every)
        z = sim.noise.advance(rows.idx, at)
        est = noisy_estimate(sim.output[rows.idx] - at, at, z, sim.prior, sim.cfg.max_output_tokens)
        out: FloatArray = np.maximum(est - (gen - at), 1.0)
        return out

    def planner_remaining(
        self, true_remaining: IntArray, predicted: FloatArray | None
    ) -> FloatArray:
        """R-hat as this mode's planner sees it (``trace.remaining_for``), vectorised."""
        mode = self.sim.mode
        if mode.kind is ModeKind.CURRENT:
            return np.full(true_remaining.size, np.inf)
        if mode.kind is ModeKind.ORACLE or predicted is None:
            return np.maximum(true_remaining.astype(np.float64), 1.0)
        pred = np.where(np.isnan(predicted), np.inf, np.maximum(predicted, 1.0))
        if mode.kind is ModeKind.BINS:
            pred = np.array(
                [bin_value(v, mode.bins) if math.isfinite(v) else v for v in pred.tolist()]
            )
        return pred

    @cached_property
    def traces(self) -> FloatArray:
        """L_i(tau_j) for every instance, as workers pre-simulate it (paper §5.2).

        The planner's own trace math (:func:`star.planner.trace.cutoffs`,
        :func:`~star.planner.trace.traces_from_arrays`) over the running
        requests, with requests migrating in booked on their target.
        """
        sim = self.sim
        run = self.running
        predicted = self.predicted if sim.mode.kind in PREDICTING else None
        remaining = self.planner_remaining(run.true_remaining, predicted)
        owner, tokens = run.owner, run.tokens
        if any(sim.incoming):
            inc = self.incoming
            remaining = np.concatenate(
                (remaining, self.planner_remaining(inc.true_remaining, inc.predicted))
            )
            owner = np.concatenate((owner, inc.owner))
            tokens = np.concatenate((tokens, inc.tokens))
        out: FloatArray = traces_from_arrays(
            owner, tokens, cutoffs(remaining, sim.tau), sim.n, sim.tau
        )
        return out

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
