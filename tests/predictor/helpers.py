"""Synthetic predictor data: hidden states that encode the remaining length (plus noise)."""

from __future__ import annotations

import numpy as np

from star.predictor.dataset import Samples


def synthetic(requests: int = 120, dim: int = 8, seed: int = 0, every: int = 20) -> Samples:
    """Rows every ``every`` tokens of ``requests`` answers; feature 0 is remaining/100 + noise."""
    rng = np.random.default_rng(seed)
    cols: dict[str, list[float]] = {k: [] for k in ("g", "rem", "final", "req", "prompt")}
    hidden = []
    for r in range(requests):
        final = int(rng.integers(5, 400))
        for g in [0, *range(every - (r % every), final, every)]:
            h = rng.normal(size=dim).astype(np.float32)
            h[0] = (final - g) / 100.0 + rng.normal(scale=0.05)
            hidden.append(h)
            cols["g"].append(g)
            cols["rem"].append(final - g)
            cols["final"].append(final)
            cols["req"].append(r)
            cols["prompt"].append(r // 2)
    i64 = lambda k: np.array(cols[k], dtype=np.int64)  # noqa: E731
    return Samples(
        hidden=np.stack(hidden),
        generated=i64("g"),
        remaining=i64("rem"),
        final=i64("final"),
        request=i64("req"),
        prompt=i64("prompt"),
        capped=np.zeros(len(hidden), dtype=bool),
    )
