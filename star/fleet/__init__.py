"""Fleet supervision: start, watch and stop a local STAR fleet; steer it by hand.

The library under ``star up`` and ``star migrate`` (the CLI only parses
arguments and calls it) and under the benchmarks and tests that run a real
fleet:

- :mod:`star.fleet.processes`: :class:`Launcher` starts each child in a
  process group of its own and stops the groups whole; :func:`group_members`;
  :class:`Terminated` (a SIGTERM unwinding like Ctrl-C).
- :mod:`star.fleet.private_redis`: whether a Redis answers; a private,
  password-protected ``redis-server``.
- :mod:`star.fleet.cluster`: :class:`LocalCluster` (Redis, workers,
  scheduler, proxy), readiness waits, and the refusal of a second cluster on
  one bus.
- :mod:`star.fleet.manual`: a manual migration decision, published and
  followed to its outcome.
- :mod:`star.fleet.status`: the status document ``star status`` prints,
  read from the bus.
- :mod:`star.fleet.feed`: the bus folded into ``star top``'s state.
"""

from __future__ import annotations

from star.fleet.cluster import (
    SECRET_ENV,
    LocalCluster,
    live_cluster,
    refuse_a_second_cluster,
)
from star.fleet.errors import ClusterError, FleetError
from star.fleet.manual import find_source, manual_decision, migrate
from star.fleet.private_redis import redis_answers, start_private_redis
from star.fleet.processes import (
    Child,
    Launcher,
    Terminated,
    group_members,
    on_sigterm_raise,
    restore_sigterm,
)

__all__ = [
    "SECRET_ENV",
    "Child",
    "ClusterError",
    "FleetError",
    "Launcher",
    "LocalCluster",
    "Terminated",
    "find_source",
    "group_members",
    "live_cluster",
    "manual_decision",
    "migrate",
    "on_sigterm_raise",
    "redis_answers",
    "refuse_a_second_cluster",
    "restore_sigterm",
    "start_private_redis",
]
