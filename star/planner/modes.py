"""Planner modes (paper §6.1 "Baselines"): how the planner sees a request's future.

Apart from :mod:`star.planner.types` so that :mod:`star.settings` can check a
configured mode without importing the planner's types, which build
:class:`~star.planner.types.PlannerParams` from settings.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class ModeKind(enum.StrEnum):
    """How the planner sees a request's future (paper §6.1 "Baselines")."""

    NO_MIGRATION = "no-migration"  # vLLM baseline: P->D dispatch only
    CURRENT = "current"  # STAR w/o prediction: H = 0, c_r = N(r)
    PREDICTED = "predicted"  # STAR: R-hat from the length predictor
    ORACLE = "oracle"  # true remaining lengths (simulator, tests)
    BINS = "bins"  # R-hat quantised to the paper's Table 4 bins


@dataclass(frozen=True, slots=True)
class Mode:
    """A planner mode; ``bins`` carries its bin count (2, 4 or 6)."""

    kind: ModeKind
    bins: int = 0

    @classmethod
    def parse(cls, text: str) -> Mode:
        """Parse ``no-migration``, ``current``, ``predicted``, ``oracle`` or ``bins:K``."""
        name, _, arg = text.strip().partition(":")
        try:
            kind = ModeKind(name)
        except ValueError:
            choices = ", ".join(k.value for k in ModeKind if k is not ModeKind.BINS)
            raise ValueError(f"unknown mode {text!r}; expected one of {choices}, bins:K") from None
        if kind is ModeKind.BINS:
            if arg not in {"2", "4", "6"}:
                raise ValueError(f"mode {text!r}: bins takes 2, 4 or 6 (paper Table 4)")
            return cls(kind, int(arg))
        if arg:
            raise ValueError(f"mode {text!r}: only bins takes an argument")
        return cls(kind)

    def __str__(self) -> str:
        return f"bins:{self.bins}" if self.kind is ModeKind.BINS else self.kind.value
