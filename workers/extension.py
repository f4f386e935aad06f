"""The one class vLLM mixes into its worker (engine argument ``worker_extension_cls``).

vLLM takes a single extension class, so STAR's worker-side pieces are
combined here: the hidden-state tap (:mod:`workers.tap`), the emulated
device clock (:mod:`workers.pacing`) and seeded sampling that survives a
chunked prefill on CPU (:mod:`workers.seeded`). Their methods carry distinct
prefixes.
"""

from __future__ import annotations

from workers.pacing import DevicePacer
from workers.seeded import SeededSampling
from workers.tap import HiddenStateTap

QUALNAME = "workers.extension.StarWorkerExtension"


class StarWorkerExtension(HiddenStateTap, DevicePacer, SeededSampling):
    """``star_tap_*``, ``star_pace_*`` and ``star_seeded_*`` methods, driven by ``collective_rpc``."""
