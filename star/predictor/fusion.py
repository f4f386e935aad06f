"""The live predictor's per-request fusion state, kept in arrays (paper §5.3).

:class:`FusionBook` holds, per request, :func:`star.predictor.model.fuse_step`'s
state (sum of weights, sum of weighted final lengths), its cap (the most
output tokens it may still reach), the R-hat served and the tokens generated
then. :meth:`FusionBook.fuse` folds one round of the MLP's raw outputs in
(:func:`star.predictor.kernels.fuse_round`, one compiled call, one dictionary
lookup per row). Pure: the worker's tap (``workers/tap.py``) reads vLLM and
says what a new request starts from.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

_NONE = np.zeros(0)  # fuse_round's per-row arrays for new requests, in a round without any

FirstOf = Callable[[str], tuple[int, int, list[float] | None]]
"""For a request seen for the first time: (its cap; the tokens it generated on
other engines before, 0 if none; the fusion state it brings, or None)."""


class FusionBook:
    """Per-request fusion state, in the order of :attr:`slot`."""

    def __init__(self, decay: float = 0.0, power: float = 0.0, first_weight: float = 1.0) -> None:
        self.decay = decay
        self.power = power
        self.first_weight = first_weight  # the prompt row's extra weight
        self.slot: dict[str, int] = {}
        # Requests continued here after a handoff: tokens generated before (their
        # final lengths here are counted from the continuation's prompt).
        self.moved: dict[str, int] = {}
        self.weight = np.zeros(0)
        self.total = np.zeros(0)
        self.cap = np.zeros(0)
        self.served = np.zeros(0)
        self.generated = np.zeros(0)

    def fuse(
        self,
        due: bool,
        ids: list[str],
        raw: Any,
        generated: Any,
        fast: Any,
        first_of: FirstOf,
    ) -> None:
        """Fuse one round into each request's served R-hat (hard-bounded by its cap).

        ``raw`` is the MLP's output for the rows ``ids`` (``fast``: the
        :class:`~star.predictor.model.FastPredictor` that made it), ``generated``
        their tokens generated so far. A ``due`` round holds every running
        request, so the ones it lacks are forgotten; any other round only
        adds requests whose prompt just completed and updates known ones.
        """
        from star.predictor.kernels import fuse_round

        slot = self.slot
        found = [slot.get(rid, -1) for rid in ids]
        at = np.array(found, dtype=np.intp)
        any_new = -1 in found
        weight0, total0, cap0, from_at = self.weight, self.total, self.cap, at
        if any_new:  # a request's first round: its prompt's row, unless it was moved here
            fresh = np.flatnonzero(at < 0)
            first = np.ones(len(ids))
            fresh_cap = np.zeros(len(ids))
            carried: list[tuple[int, int, list[float]]] = []  # (row, cap, fusion state)
            for i in fresh.tolist():
                cap_i, before, fusion = first_of(ids[i])
                fresh_cap[i] = cap_i
                if not before:
                    first[i] = self.first_weight
                    continue
                self.moved[ids[i]] = before
                if fusion is not None and len(fusion) == 2:
                    # Final lengths here count from the continuation's prompt.
                    carried.append((i, cap_i, [fusion[0], fusion[1] - before * fusion[0]]))
            if carried:
                # Rows that bring a fusion state continue it, as known rows do.
                base = len(self.weight)
                from_at = at.copy()
                from_at[[i for i, _, _ in carried]] = np.arange(base, base + len(carried))
                weight0 = np.concatenate([self.weight, [w for _, _, (w, _) in carried]])
                total0 = np.concatenate([self.total, [t for _, _, (_, t) in carried]])
                cap0 = np.concatenate([self.cap, [float(c) for _, c, _ in carried]])
        else:
            first = fresh_cap = _NONE
        g = generated.astype(np.float64)
        weight, total, cap, served = fuse_round(
            raw,
            fast.log_target,
            fast.uncertainty,
            fast.scale,
            from_at,
            first,
            fresh_cap,
            g,
            weight0,
            total0,
            cap0,
            self.decay,
            self.power,
        )
        if due:
            self.slot = dict(zip(ids, range(len(ids)), strict=True))
            if self.moved:
                self.moved = {rid: n for rid, n in self.moved.items() if rid in self.slot}
            self.weight, self.total, self.cap, self.served, self.generated = (
                weight,
                total,
                cap,
                served,
                g,
            )
            return
        # A prompt-completion round: update the known requests, append the new.
        new = at < 0
        known = at[~new]
        for name, value in (
            ("weight", weight),
            ("total", total),
            ("cap", cap),
            ("served", served),
            ("generated", g),
        ):
            column = getattr(self, name)
            column[known] = value[~new]
            if any_new:
                setattr(self, name, np.concatenate([column, value[new]]))
        if any_new:
            base = len(slot)
            for k, i in enumerate(np.flatnonzero(new).tolist()):
                slot[ids[i]] = base + k

    def requests(self) -> dict[str, list[float]]:
        """Per request ``[R-hat, generated, weight, total]``: the last R-hat served,
        the tokens generated then, and the fusion state to hand over with it
        (sum of weights, sum of weighted final lengths counted from the
        original prompt)."""
        moved = self.moved
        return {
            rid: [
                float(self.served[i]),
                int(self.generated[i]),
                float(self.weight[i]),
                float(self.total[i] + moved.get(rid, 0) * self.weight[i]),
            ]
            for rid, i in self.slot.items()
        }
