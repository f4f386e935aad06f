"""``star top``'s sans-IO core: fold bus messages into a fleet view, render a frame.

The command (``star.cli.top``) reads the streams and the clock; this package
does neither, so the fold and the layout are tested with plain tables.
"""

from __future__ import annotations

from star.top.render import bar, render, render_view
from star.top.state import DecisionRow, FleetView, InstanceRow, Leader, TopState

__all__ = [
    "DecisionRow",
    "FleetView",
    "InstanceRow",
    "Leader",
    "TopState",
    "bar",
    "render",
    "render_view",
]
