"""The rescheduling planner: paper §5 (Algorithm 1) as a sans-IO function.

``plan(instances, params)`` takes the decode instances as the scheduler sees
them at one tick and returns the migrations to make; it does no IO and reads
no clock, so the live scheduler, ``star plan`` and the simulator share it.
"""

from __future__ import annotations

from star.planner.core import plan
from star.planner.trace import BIN_EDGES, remaining_for, weights
from star.planner.types import (
    Candidate,
    Instance,
    Mode,
    ModeKind,
    Move,
    Plan,
    PlannerParams,
    Request,
    Verdict,
    validate_params,
)

__all__ = [
    "BIN_EDGES",
    "Candidate",
    "Instance",
    "Mode",
    "ModeKind",
    "Move",
    "Plan",
    "PlannerParams",
    "Request",
    "Verdict",
    "plan",
    "remaining_for",
    "validate_params",
    "weights",
]
