"""What the fleet library raises."""

from __future__ import annotations


class FleetError(Exception):
    """A fleet cannot be started or steered as asked (bad input, a port taken,
    a cluster already running); the CLI reports it in one line."""


class ClusterError(Exception):
    """A cluster process died or the cluster did not become ready."""
