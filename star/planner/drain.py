"""Evacuating draining instances (an operational addition to paper Algorithm 1).

A worker that is stopping (SIGTERM, ``systemctl stop``) reports ``draining``:
it takes no new requests and waits, up to its ``drain_timeout_s``, for the
running ones to end; those still running then are aborted. Algorithm 1 moves
a request only when that lowers the expected load variance, so a draining
instance that is not overloaded would keep its requests to the end. Here,
after Algorithm 1 has decided a tick's moves, every draining instance that
takes part in none of them (and in no migration in flight) moves one more
request out, whatever that does to the variance:

- the request: one that may move (migratable, not already migrating) and is
  worth moving by Algorithm 1's own rule (Phase 2: R-hat(r) >
  C_mig(r)/T_exec, it would not end before the move does); the longest
  R-hat first, among equal ones (no prediction: ``current`` mode) the one
  with the least KV to move;
- the target: the least loaded (w_t) instance that is not draining, in no
  migration (this tick's or in flight), and has room for the request over
  the horizon (Phase 2's max_j (L_t(tau_j) + c_r(tau_j)) <= C_mem,t).

One request per draining instance per tick, as for any instance (docs/design.md §3:
an instance takes part in one migration at a time). ``no-migration`` mode
moves nothing, drain or not.
"""

from __future__ import annotations

import numpy as np

from star.planner.arrays import ArrayPlan, ClusterArrays
from star.planner.kernels import IntArray
from star.planner.trace import contribution, grid, too_short, weights
from star.planner.types import ModeKind, PlannerParams


def evacuations(
    arrays: ClusterArrays, decided: ArrayPlan, params: PlannerParams
) -> list[tuple[int, int, int, float]]:
    """This tick's evacuation moves, as (request row, source, target, Delta-V).

    ``decided`` is Algorithm 1's plan of the same tick on ``arrays``; the
    instances in its moves take part in no evacuation. Delta-V is the move's
    change of the expected load variance (usually > 0: a drain is not a
    rebalance); the instances of all of a tick's moves being distinct, and
    the total load unchanged by a move, the changes add up.
    """
    if arrays.draining is None or params.mode.kind is ModeKind.NO_MIGRATION:
        return []
    n = arrays.size
    taken = arrays.in_flight.copy()
    taken[decided.sources] = True
    taken[decided.targets] = True
    free = ~taken & ~arrays.draining
    sources: IntArray = np.flatnonzero(arrays.draining & ~taken)
    if not sources.size or not free.any():
        return []
    tau = grid(params)
    # Only instances in no move are looked at: the traces the tick began with.
    traces = decided.traces
    remaining = decided.remaining_all
    tokens = arrays.tokens
    step = np.where(arrays.step_time_s > 0, arrays.step_time_s, params.default_step_time_s)
    beta = weights(params)
    moves: list[tuple[int, int, int, float]] = []
    for s in sources.tolist():
        rows = np.arange(arrays.offsets[s], arrays.offsets[s + 1])
        rows = rows[arrays.eligible[rows]]
        rows = rows[
            ~too_short(tokens[rows], remaining[rows], arrays.bytes_per_token[s], step[s], params)
        ]
        # Longest R-hat first; among equal ones the least KV (lexsort: last key first).
        for q in rows[np.lexsort((tokens[rows], -remaining[rows]))].tolist():
            adds = contribution(tokens[q], remaining[q], tau)
            room = free & ((traces + adds).max(axis=1) <= arrays.capacity)
            if not room.any():
                continue
            fits = np.flatnonzero(room)
            t = int(fits[np.argmin(decided.workloads[fits])])
            # Var = mean of squares - square of the (unchanged) mean, per tau_j.
            delta_v = 2.0 / n * float(beta @ (adds * (adds + traces[t] - traces[s])))
            moves.append((q, s, t, delta_v))
            free[t] = False
            break
        if not free.any():
            break
    return moves
