"""The predictor's data set: safetensors shards plus a JSON index (paper §4.2, docs/design.md §6).

One row per (request, moment): the last-layer hidden state of the request's
last token, the tokens generated so far, the remaining length (tokens still
to come, end token included), the final length, whether ``max_tokens`` cut
the answer, and integer request and prompt ids. Rows are taken every k = 20
decode steps plus once at the end of the prompt (zero tokens generated).

Layout of a data directory::

    index.json               what was collected, the shards, where to resume
    shard-00000.safetensors  hidden (n, d) float32 and the per-row columns
    ...

Shards are written whole and the index is replaced atomically after each, so
an interrupted collection resumes at the first request of the shard it lost.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

INDEX = "index.json"
INDEX_VERSION = 1
COLUMNS = ("generated", "remaining", "final", "request", "prompt", "capped")


class DatasetError(ValueError):
    """A data directory is missing, inconsistent or was collected differently."""


@dataclass
class Samples:
    """Rows in memory (numpy); ``hidden`` is (n, d) float32, the rest (n,)."""

    hidden: npt.NDArray[np.float32]
    generated: npt.NDArray[np.int64]
    remaining: npt.NDArray[np.int64]
    final: npt.NDArray[np.int64]
    request: npt.NDArray[np.int64]
    prompt: npt.NDArray[np.int64]
    capped: npt.NDArray[np.bool_]

    def __len__(self) -> int:
        return int(self.remaining.shape[0])

    @property
    def dim(self) -> int:
        return int(self.hidden.shape[1])

    def take(self, mask: npt.NDArray[np.bool_] | npt.NDArray[np.intp]) -> Samples:
        return Samples(
            self.hidden[mask],
            self.generated[mask],
            self.remaining[mask],
            self.final[mask],
            self.request[mask],
            self.prompt[mask],
            self.capped[mask],
        )

    @classmethod
    def from_columns(cls, hidden: Any, columns: Mapping[str, Any]) -> Samples:
        """Rows from a hidden-state matrix and the :data:`COLUMNS` arrays."""
        ints = {c: np.asarray(columns[c], dtype=np.int64) for c in COLUMNS[:-1]}
        return cls(
            hidden=np.asarray(hidden, dtype=np.float32),
            capped=np.asarray(columns["capped"], dtype=bool),
            **ints,
        )

    @classmethod
    def concat(cls, parts: Sequence[Samples], dim: int) -> Samples:
        if not parts:
            return cls.from_columns(np.zeros((0, dim)), {c: np.zeros(0) for c in COLUMNS})
        return cls.from_columns(
            np.concatenate([p.hidden for p in parts]),
            {c: np.concatenate([getattr(p, c) for p in parts]) for c in COLUMNS},
        )


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


class DataDir:
    """A data directory being written (or resumed), and read back."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        self.index: dict[str, Any] = {}
        if (self.root / INDEX).is_file():
            try:
                self.index = json.loads((self.root / INDEX).read_text())
            except json.JSONDecodeError as exc:
                raise DatasetError(f"{self.root / INDEX}: not JSON ({exc})") from None
            if self.index.get("version") != INDEX_VERSION:
                raise DatasetError(
                    f"{self.root / INDEX}: unknown version {self.index.get('version')!r}"
                )

    @property
    def exists(self) -> bool:
        return bool(self.index)

    def start(self, meta: Mapping[str, Any]) -> None:
        """Begin a new collection, or check that a resumed one was collected the same way.

        ``meta`` holds what fixes the data (model, hidden size, workload, seed,
        k, sampling); a resume with different values is refused.
        """
        if self.exists:
            old = self.index["meta"]
            diff = sorted(k for k in set(old) | set(meta) if old.get(k) != meta.get(k))
            if diff:
                raise DatasetError(
                    f"{self.root} was collected with other settings ({', '.join(diff)}): "
                    "use another --out or the same settings"
                )
            return
        self.root.mkdir(parents=True, exist_ok=True)
        self.index = {"version": INDEX_VERSION, "meta": dict(meta), "shards": [], "next_request": 0}
        _atomic_write(self.root / INDEX, json.dumps(self.index, indent=1) + "\n")

    @property
    def next_request(self) -> int:
        return int(self.index.get("next_request", 0))

    @property
    def rows(self) -> int:
        return sum(int(s["rows"]) for s in self.index.get("shards", []))

    def append(
        self, samples: Samples, next_request: int, requests: Sequence[Mapping[str, Any]]
    ) -> None:
        """Write one shard and move the resume point to ``next_request``."""
        from safetensors.numpy import save_file

        n = len(self.index["shards"])
        name = f"shard-{n:05d}.safetensors"
        tensors = {"hidden": np.ascontiguousarray(samples.hidden, dtype=np.float32)}
        for col in COLUMNS:
            arr = getattr(samples, col)
            tensors[col] = np.ascontiguousarray(
                arr, dtype=np.uint8 if col == "capped" else np.int64
            )
        save_file(tensors, str(self.root / name))
        digest = hashlib.sha256((self.root / name).read_bytes()).hexdigest()
        self.index["shards"].append(
            {"file": name, "rows": len(samples), "sha256": digest, "requests": list(requests)}
        )
        self.index["next_request"] = int(next_request)
        _atomic_write(self.root / INDEX, json.dumps(self.index, indent=1) + "\n")

    def data_hash(self) -> str:
        """A digest of every shard's digest: names the exact data a predictor saw."""
        h = hashlib.sha256()
        for s in self.index.get("shards", []):
            h.update(s["sha256"].encode())
        return h.hexdigest()

    def load(self) -> Samples:
        """All rows of the directory."""
        from safetensors.numpy import load_file

        if not self.exists:
            raise DatasetError(
                f"no {INDEX} in {self.root}: run `star predictor collect --out {self.root}`"
            )
        dim = int(self.index["meta"]["hidden_size"])
        parts = []
        for s in self.index["shards"]:
            path = self.root / s["file"]
            if not path.is_file():
                raise DatasetError(f"{path} is listed in {INDEX} but missing")
            t = load_file(str(path))
            parts.append(Samples.from_columns(t["hidden"], t))
        return Samples.concat(parts, dim)
