"""The hidden-state tap: a vLLM worker extension (paper §4, §5.3; DESIGN §6).

:class:`HiddenStateTap` is mixed into vLLM's worker class by qualified name
(engine argument ``worker_extension_cls``, see ``docs/vllm-notes.md`` §5) and
driven from the front end with ``AsyncLLM.collective_rpc``. Installing it wraps
the model's ``compute_logits``, which both V1 model runners call once per step
with the last-layer hidden state of each scheduled request's last token, in
the input batch's request order.

Every ``every`` steps (paper Table 5: k = 20) the wrapper takes those rows for
all requests that are decoding (a partial prefill's row is discarded by vLLM
and skipped here), plus, on any step, the row of each request whose prompt
completes in that step (zero tokens generated: the prompt-only sample; found
with one vectorised comparison). With a predictor it runs the MLP on them in
one batch and serves, per request, R-hat = T - generated, where T is an
exponential average over the request's rounds of the predicted final length
R-hat_i + generated_i (weight ``alpha`` from the checkpoint on the newest;
``star_tap_predictions``). In collection mode it keeps the hidden states
themselves (``star_tap_drain``). With neither, the wrapper does nothing but
count steps.

The rows carry vLLM's *internal* request ids (the caller's id plus
``-`` and 8 random characters); :func:`external_id` maps them back.

On GPU with async scheduling a request's token count may lag one token
behind the row (the sampled token is appended after the step); the predictor
does not care about one token.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import structlog

log = structlog.get_logger(__name__)

QUALNAME = "workers.tap.HiddenStateTap"


def external_id(internal: str) -> str:
    """The caller's request id of a vLLM internal id (``<external>-<8 chars>``)."""
    head, sep, tail = internal.rpartition("-")
    return head if sep and len(tail) == 8 else internal


class _TapState:
    """What the wrapper keeps between calls (one per worker process)."""

    def __init__(self, every: int, predictor: Any, collect: bool) -> None:
        self.every = every
        self.predictor = predictor  # star.predictor.model.LengthPredictor or None
        self.collect = collect
        self.calls = 0
        self.predictions: dict[str, tuple[float, int]] = {}
        self.predict_s = 0.0
        self.predict_batches = 0
        self.predict_rows = 0
        self.samples: list[tuple[str, int, int]] = []  # (req id, prompt tokens, generated)
        self.hidden: list[Any] = []  # float32 CPU tensors, rows matching ``samples``
        self.totals: dict[str, float] = {}  # smoothed predicted final length per request
        self.alpha = float(predictor.config.alpha) if predictor is not None else 1.0


class HiddenStateTap:
    """Worker-extension methods (names prefixed ``star_tap_``: no clash with the worker's)."""

    model_runner: Any  # provided by vLLM's worker class

    def star_tap_install(
        self, every: int, checkpoint: str = "", collect: bool = False
    ) -> dict[str, Any]:
        """Wrap ``compute_logits``; load the predictor at ``checkpoint`` (empty: none).

        Installing again replaces the settings (the wrapper is installed once).
        Returns ``{"hidden_size": d, "predictor": bool}``.
        """
        import torch

        if every < 1:
            raise ValueError(f"every must be >= 1, got {every}")
        predictor = None
        if checkpoint:
            from star.predictor.model import load_checkpoint

            predictor = load_checkpoint(checkpoint).model.eval()
        runner = self.model_runner
        model = runner.model
        state = _TapState(every, predictor, collect)
        existing = getattr(self, "_star_tap", None)
        self._star_tap = state
        if existing is None:
            original = model.compute_logits

            def compute_logits(hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
                tap: _TapState = self._star_tap
                tap.calls += 1
                if tap.predictor is not None or tap.collect:
                    self._star_tap_take(tap, hidden_states)
                return original(hidden_states, *args, **kwargs)

            model.compute_logits = compute_logits
        hidden_size = int(runner.model_config.get_hidden_size())
        if predictor is not None and predictor.input_dim != hidden_size:
            raise ValueError(
                f"predictor expects hidden size {predictor.input_dim}, the model has {hidden_size}"
            )
        return {"hidden_size": hidden_size, "predictor": predictor is not None}

    def _star_tap_take(self, tap: _TapState, hidden_states: Any) -> None:
        import numpy as np
        import torch

        runner = self.model_runner
        batch = runner.input_batch
        n = int(batch.num_reqs)
        if n == 0 or int(hidden_states.shape[0]) < n:  # not the sampling call of a step
            return
        t0 = time.perf_counter()
        keep = ~runner.discard_request_mask.np[:n]  # a partial prefill samples nothing
        due = tap.calls % tap.every == 0
        if not due:
            # Only requests whose prompt completes in this step (their first row,
            # zero tokens generated): one vectorised comparison per step.
            keep = keep & (batch.num_computed_tokens_cpu[:n] < batch.num_prompt_tokens[:n])
            if not keep.any():
                return
        rows = np.flatnonzero(keep).tolist()
        ids = [batch.req_ids[i] for i in rows]
        prompt = batch.num_prompt_tokens[rows].tolist()
        generated = [
            int(runner.requests[rid].num_tokens) - p for rid, p in zip(ids, prompt, strict=True)
        ]
        with torch.inference_mode():
            picked = hidden_states[rows].detach().float()
            if tap.predictor is not None:
                out = tap.predictor.predict(picked).tolist()
                # The served R-hat: an exponential average over rounds of the
                # predicted final length (R-hat + generated), minus what is
                # generated now; alpha = 1 is the last round alone.
                alpha = tap.alpha
                totals = tap.totals if not due else {}
                for rid, r, g in zip(ids, out, generated, strict=True):
                    prev = tap.totals.get(rid)
                    total = r + g if prev is None else (1 - alpha) * prev + alpha * (r + g)
                    totals[rid] = total
                    tap.predictions[rid] = (max(total - g, 0.0), g)
                if due:  # every running request was in this round: forget the rest
                    tap.totals = totals
                    tap.predictions = {rid: tap.predictions[rid] for rid in totals}
                tap.predict_s += time.perf_counter() - t0
                tap.predict_batches += 1
                tap.predict_rows += len(rows)
            if tap.collect:
                tap.hidden.append(picked.cpu())
                tap.samples.extend(zip(ids, prompt, generated, strict=True))

    def star_tap_predictions(self) -> dict[str, Any]:
        """The last prediction round: ``{"requests": {id: [R-hat, generated]}, timing...}``."""
        tap: _TapState | None = getattr(self, "_star_tap", None)
        if tap is None:
            return {"requests": {}, "predict_s": 0.0, "batches": 0, "rows": 0, "steps": 0}
        return {
            "requests": {rid: [r, g] for rid, (r, g) in tap.predictions.items()},
            "predict_s": tap.predict_s,
            "batches": tap.predict_batches,
            "rows": tap.predict_rows,
            "steps": tap.calls,
        }

    def star_tap_drain(self) -> dict[str, Any]:
        """Collected samples since the last drain: ids, token counts, float32 rows as bytes."""
        import torch

        tap: _TapState | None = getattr(self, "_star_tap", None)
        if tap is None or not tap.samples:
            return {"ids": [], "prompt": [], "generated": [], "hidden": b"", "dim": 0}
        hidden = torch.cat(tap.hidden).numpy()
        samples = tap.samples
        tap.samples, tap.hidden = [], []
        return {
            "ids": [s[0] for s in samples],
            "prompt": [s[1] for s in samples],
            "generated": [s[2] for s in samples],
            "hidden": hidden.tobytes(),
            "dim": int(hidden.shape[1]),
        }


# -- the front-end side -------------------------------------------------------------------


@dataclass
class TapTiming:
    """Predictor cost so far, as the engine's worker measured it."""

    predict_s: float = 0.0
    batches: int = 0
    rows: int = 0
    steps: int = 0

    @property
    def mean_batch_s(self) -> float:
        """Mean time of one prediction round (all running requests in one batch)."""
        return self.predict_s / self.batches if self.batches else 0.0


class TapClient:
    """Drives :class:`HiddenStateTap` in an ``AsyncLLM``'s worker(s) by ``collective_rpc``."""

    def __init__(self, llm: Any) -> None:
        self._llm = llm
        self.installed = False
        self.every = 0
        self.hidden_size = 0
        self.has_predictor = False
        self.timing = TapTiming()

    async def install(self, every: int, checkpoint: str = "", collect: bool = False) -> int:
        """Install (or re-configure) the tap; returns the model's hidden size."""
        results = await self._llm.collective_rpc(
            "star_tap_install", args=(int(every), str(checkpoint), bool(collect))
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
        )
        out: dict[str, float] = {}
        for internal, (r_hat, g) in result["requests"].items():
            rid = external_id(internal)
            now = generated.get(rid)
            if now is not None:
                out[rid] = max(float(r_hat) - max(now - int(g), 0), 1.0)
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
        log.info("no length predictor for this model: reports carry no R-hat", model=engine.model)
        return None
    ckpt = load_checkpoint(path)
    hidden = await engine.install_tap(every, str(path))
    if ckpt.config.input_dim != hidden:
        raise ValueError(
            f"predictor {path} expects hidden size {ckpt.config.input_dim}, the model has {hidden}"
        )
    log.info(
        "length predictor installed",
        checkpoint=str(path),
        every=every,
        metrics=ckpt.metadata.get("metrics", {}).get("mlp-ema"),
    )
    return str(path)
