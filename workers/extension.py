"""The one class vLLM mixes into its worker (engine argument ``worker_extension_cls``).

vLLM takes a single extension class, so STAR's worker-side pieces are
combined here: the hidden-state tap (:mod:`workers.tap`), the emulated
device clock (:mod:`workers.pacing`), seeded sampling that survives a
chunked prefill on CPU (:mod:`workers.seeded`) and the resumption of a
migrated request as a true continuation (:mod:`workers.continuation`). Their methods carry distinct
prefixes.
"""

from __future__ import annotations

from workers.continuation import Continuation
from workers.pacing import DevicePacer
from workers.seeded import SeededSampling
from workers.tap import HiddenStateTap

QUALNAME = "workers.extension.StarWorkerExtension"


class StarWorkerExtension(HiddenStateTap, DevicePacer, SeededSampling, Continuation):
    """``star_tap_*``, ``star_pace_*``, ``star_seeded_*`` and ``star_continuation_*`` methods,
    driven by ``collective_rpc``."""
