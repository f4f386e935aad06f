"""The one class vLLM mixes into its worker (engine argument ``worker_extension_cls``).

vLLM takes a single extension class, so STAR's worker-side pieces are
combined here: the hidden-state tap (:mod:`workers.tap`) and the emulated
device clock (:mod:`workers.pacing`). Their methods carry distinct prefixes.
"""

from __future__ import annotations

from workers.pacing import DevicePacer
from workers.tap import HiddenStateTap

QUALNAME = "workers.extension.StarWorkerExtension"


class StarWorkerExtension(HiddenStateTap, DevicePacer):
    """``star_tap_*`` and ``star_pace_*`` methods, driven by ``collective_rpc``."""
