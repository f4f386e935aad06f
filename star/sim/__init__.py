"""A discrete-event simulator of a PD-disaggregated cluster (paper §6.3), sans IO.

``simulate(SimConfig(...))`` runs one cluster for a simulated duration and
returns a :class:`SimResult`; :func:`star.sim.sweep.sweep` runs many on a
process pool. Every tick calls the live scheduler's planner
(:func:`star.planner.plan`) and every P->D dispatch the proxies' rule,
:func:`star.planner.dispatch.choose_on_view` (``predicted``: ``choose_decode``).
"""

from __future__ import annotations

from star.sim.config import ConfigError, SimConfig
from star.sim.engine import Simulator, simulate
from star.sim.metrics import ROW_KEYS, SimResult
from star.sim.workload import Workload, WorkloadError

__all__ = [
    "ROW_KEYS",
    "ConfigError",
    "SimConfig",
    "SimResult",
    "Simulator",
    "Workload",
    "WorkloadError",
    "simulate",
]
