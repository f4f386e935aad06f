"""The front-end side of the hidden-state tap: :class:`TapClient` drives
:class:`workers.tap.HiddenStateTap` in an ``AsyncLLM``'s worker(s) through
``collective_rpc`` (install, predictions, collected rows) and maps vLLM's
internal request ids back to the caller's; :func:`start_tap` installs it with
a length predictor on a decode engine."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import structlog

log = structlog.get_logger(__name__)


def external_id(internal: str) -> str:
    """The caller's request id of a vLLM internal id (``<external>-<8 chars>``)."""
    head, sep, tail = internal.rpartition("-")
    return head if sep and len(tail) == 8 else internal


@dataclass
class TapTiming:
    """Predictor cost so far, as the engine's worker measured it."""

    predict_s: float = 0.0  # in prediction rounds (row selection, MLP, fusion)
    batches: int = 0
    rows: int = 0
    steps: int = 0
    check_s: float = 0.0  # on the other steps (is a prompt completing?)
    tap_cpu_s: float = 0.0  # with profile: the tap's thread CPU time
    step_cpu_s: float = 0.0  # with profile: the model steps' thread CPU time (tap included)
    step_s: float = 0.0  # with profile: the model steps' wall-clock time in the worker

    @property
    def mean_batch_s(self) -> float:
        """Mean time of one prediction round (all running requests in one batch)."""
        return self.predict_s / self.batches if self.batches else 0.0

    @property
    def total_s(self) -> float:
        """All the time the tap added to the engine's steps."""
        return self.predict_s + self.check_s


class TapClient:
    """Drives :class:`HiddenStateTap` in an ``AsyncLLM``'s worker(s) by ``collective_rpc``."""

    def __init__(self, llm: Any) -> None:
        self._llm = llm
        self.installed = False
        self.every = 0
        self.hidden_size = 0
        self.has_predictor = False
        self.timing = TapTiming()
        # External id -> fusion state as of the last predictions() (FUSION_KEY):
        # handed over with a released request.
        self.fusion: dict[str, list[float]] = {}

    async def install(
        self, every: int, checkpoint: str = "", collect: bool = False, profile: bool = False
    ) -> int:
        """Install (or re-configure) the tap; returns the model's hidden size."""
        results = await self._llm.collective_rpc(
            "star_tap_install", args=(int(every), str(checkpoint), bool(collect), bool(profile))
        )
        first = results[0]
        self.installed = True
        self.every = int(every)
        self.hidden_size = int(first["hidden_size"])
        self.has_predictor = bool(first["predictor"])
        return self.hidden_size

    async def predictions(self, generated: Mapping[str, int]) -> dict[str, float]:
        """R-hat now for the requests in ``generated`` (external id -> tokens generated now).

        The tap predicted R-hat when the request had generated g tokens; g' - g
        tokens later the best guess is R-hat - (g' - g), at least one token (it
        is still running). Requests without a prediction yet are left out.
        """
        if not self.installed or not self.has_predictor:
            return {}
        result = (await self._llm.collective_rpc("star_tap_predictions"))[0]
        self.timing = TapTiming(
            float(result["predict_s"]),
            int(result["batches"]),
            int(result["rows"]),
            int(result["steps"]),
            float(result.get("check_s", 0.0)),
            float(result.get("tap_cpu_s", 0.0)),
            float(result.get("step_cpu_s", 0.0)),
            float(result.get("step_s", 0.0)),
        )
        out: dict[str, float] = {}
        fusion: dict[str, list[float]] = {}
        for internal, (r_hat, g, *state) in result["requests"].items():
            rid = external_id(internal)
            now = generated.get(rid)
            if now is not None:
                out[rid] = max(float(r_hat) - max(now - int(g), 0), 1.0)
            if len(state) == 2:
                fusion[rid] = [float(state[0]), float(state[1])]
        self.fusion = fusion
        return out

    async def drain(self) -> dict[str, Any]:
        """Collected samples since the last drain (see ``HiddenStateTap.star_tap_drain``)."""
        result: dict[str, Any] = (await self._llm.collective_rpc("star_tap_drain"))[0]
        result["ids"] = [external_id(i) for i in result["ids"]]
        return result


async def start_tap(engine: Any, every: int, checkpoint: str = "") -> str | None:
    """Install the tap with a predictor on a decode engine; returns the checkpoint used.

    ``checkpoint`` empty means the one shipped next to the model
    (``MODEL/predictor/``); without one the worker reports no R-hat (the
    scheduler then treats its requests as in ``current`` mode). The checkpoint
    is loaded here first so that a bad one fails with a clear error.
    """
    from star.predictor.model import default_checkpoint, load_checkpoint

    if engine.role != "decode":
        return None
    path = checkpoint or default_checkpoint(engine.model)
    if not path:
        log.info("no_length_predictor_for_model", model=engine.model)
        return None
    ckpt = load_checkpoint(path)
    hidden = await engine.install_tap(every, str(path))
    if ckpt.config.input_dim != hidden:
        raise ValueError(
            f"predictor {path} expects hidden size {ckpt.config.input_dim}, the model has {hidden}"
        )
    log.info(
        "length_predictor_installed",
        checkpoint=str(path),
        every=every,
        metrics=ckpt.metadata.get("metrics", {}).get("mlp-fused"),
    )
    return str(path)
