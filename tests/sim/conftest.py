"""Compile the simulator's numba kernels once, in this process, before any test.

Compiled kernels are cached on disk (``__pycache__``), so the ``star
simulate`` subprocesses and pool workers the CLI tests start load them in
~0.4 s instead of each compiling them (several seconds apiece on a cold
checkout, all at once).
"""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session", autouse=True)
def _compiled_kernels() -> None:
    from star.sim.kernels import warm

    warm()
