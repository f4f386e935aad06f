"""A state machine as a table (h11 style), for both ends of the token protocol.

A table maps (state, event) to the next state; a pair missing from it is an
event that cannot happen in that state: a bug in the code that drives the
machine, raised as :class:`IllegalTransition`. The worker's stream
(:data:`workers.protocol.TRANSITIONS`) and the proxy's decode run
(:data:`proxy.migration.TRANSITIONS`) are such tables, each stepped by the
function :func:`stepper` makes of it. No IO.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping
from typing import TypeVar

S = TypeVar("S", bound=enum.Enum)
E = TypeVar("E", bound=enum.Enum)


class IllegalTransition(RuntimeError):
    """An event that cannot happen in the machine's current state (a bug in its driver)."""


def stepper(what: str, table: Mapping[tuple[S, E], S]) -> Callable[[S, E], S]:
    """``next_state(state, event)`` over ``table``; ``what`` names the machine in errors."""

    def next_state(state: S, event: E) -> S:
        """The state after ``event``; raises :class:`IllegalTransition` if it cannot happen."""
        try:
            return table[(state, event)]
        except KeyError:
            raise IllegalTransition(
                f"{what} event {event.value!r} in state {state.value!r}"
            ) from None

    return next_state
