"""The hidden-state tap: a vLLM worker extension (paper §4, §5.3; docs/design.md §6).

:class:`HiddenStateTap` is mixed into vLLM's worker class (``worker_extension_cls``,
``docs/vllm-notes.md`` §5) and driven from the front end by
:class:`workers.tap_client.TapClient`. It wraps the model's ``compute_logits``,
which gets each scheduled request's last hidden state once per step, in batch
order. Every ``every`` steps (paper Table 5: k = 20), and on the step a
prompt completes, it runs the MLP on those rows and folds them into each
request's R-hat (:class:`star.predictor.fusion.FusionBook`), never above what
the request can still produce; in collection mode it keeps the rows. It
times itself (``predict_s``, ``check_s``; with ``profile`` the steps' thread
CPU time too). Rows carry vLLM's internal request ids; on GPU with async
scheduling a token count may lag the row by one token.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import structlog

from star.predictor.fusion import FusionBook

log = structlog.get_logger(__name__)

QUALNAME = "workers.tap.HiddenStateTap"

CONTINUED_KEY = "star_continued"
"""``SamplingParams.extra_args`` key the worker sets on a request continued after a handoff.

Its value is the tokens the request had generated before; its first row here
is then mid-answer, not at the end of a real prompt, and is fused without
the prompt row's extra weight.
"""

FUSION_KEY = "star_fusion"
"""``SamplingParams.extra_args`` key of the fusion state a continued request brings along.

``[sum of weights, sum of weighted final lengths]`` on the engine it left
(as of its last :meth:`HiddenStateTap.star_tap_predictions`), final lengths
counted from the request's original prompt; its first row here continues
that fusion instead of starting one.
"""


def _tensor_rows(hidden_states: Any, n: int, rows: Any) -> Any:
    """Rows ``rows`` of a hidden-states tensor (None: the first ``n``, a view)."""
    import torch

    return hidden_states[:n] if rows is None else hidden_states[torch.from_numpy(rows)]


class _TapState:
    """What the wrapper keeps between calls (one per worker process)."""

    def __init__(self, every: int, predictor: Any, collect: bool, device: Any = None) -> None:
        from star.predictor.model import FastPredictor

        self.every = every
        self.predictor = predictor  # star.predictor.model.LengthPredictor or None
        self.fast = FastPredictor(predictor, device) if predictor is not None else None
        self.book = (
            FusionBook(
                float(predictor.config.decay),
                float(predictor.config.power),
                float(predictor.config.first_weight),
            )
            if predictor is not None
            else FusionBook()
        )
        self.collect = collect
        # Whether the rows can be read as a numpy view (float32 on the host;
        # found out on the first round).
        self.as_numpy = self.fast is not None and self.fast.host
        self.active = predictor is not None or collect
        self.calls = 0
        # Set by the step watcher when a step schedules a new or resumed
        # request; cleared by a check that finds no prompt left to complete.
        self.prefilling = True
        self.predict_s = 0.0
        self.check_s = 0.0
        self.predict_batches = 0
        self.predict_rows = 0
        self.profile = False
        self.tap_cpu_s = 0.0  # with profile: the tap's own thread CPU time
        self.step_cpu_s = 0.0  # with profile: the model steps' thread CPU time (tap included)
        self.step_s = 0.0  # with profile: the model steps' wall-clock time in the worker
        self.samples: list[tuple[str, int, int]] = []  # (req id, prompt tokens, generated)
        self.hidden: list[Any] = []  # float32 CPU tensors, rows matching ``samples``


class HiddenStateTap:
    """Worker-extension methods (names prefixed ``star_tap_``: no clash with the worker's)."""

    model_runner: Any  # provided by vLLM's worker class

    def star_tap_install(
        self, every: int, checkpoint: str = "", collect: bool = False, profile: bool = False
    ) -> dict[str, Any]:
        """Wrap ``compute_logits``; load the predictor at ``checkpoint`` (empty: none).

        Installing again replaces the settings (the wrapper is installed once).
        ``profile`` also counts thread CPU time (see the module's docstring).
        Returns ``{"hidden_size": d, "predictor": bool}``.
        """
        import torch

        if every < 1:
            raise ValueError(f"every must be >= 1, got {every}")
        runner = self.model_runner
        predictor = None
        if checkpoint:
            from star.predictor.model import load_checkpoint

            predictor = load_checkpoint(checkpoint).model.eval()
        model = runner.model
        state = _TapState(every, predictor, collect, getattr(runner, "device", None))
        state.profile = profile
        existing = getattr(self, "_star_tap", None)
        self._star_tap = state
        if existing is None:
            original = model.compute_logits
            clock = time.perf_counter
            cpu = time.thread_time

            def compute_logits(hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
                tap: _TapState = self._star_tap
                tap.calls += 1
                if tap.active and (tap.prefilling or not tap.calls % tap.every):
                    c0 = cpu() if tap.profile else 0.0
                    t0 = clock()
                    if self._star_tap_take(tap, hidden_states):
                        tap.predict_s += clock() - t0
                    else:
                        tap.check_s += clock() - t0
                    if tap.profile:
                        tap.tap_cpu_s += cpu() - c0
                return original(hidden_states, *args, **kwargs)

            model.compute_logits = compute_logits
            if hasattr(runner, "execute_model"):
                runner.execute_model = self._star_tap_watch(runner.execute_model)
        if state.fast is not None:
            if state.fast.host:
                from star.predictor.model import single_threaded_host_blas

                single_threaded_host_blas()
            # Compiled (or loaded from numba's disk cache) now, not in a model step.
            state.fast.warm()
        if profile and not getattr(self, "_star_tap_steps_timed", False):
            # Time the model steps too (only once asked: no cost otherwise).
            self._star_tap_steps_timed = True
            for name in ("execute_model", "sample_tokens"):
                if hasattr(runner, name):
                    setattr(runner, name, self._star_tap_step_timer(getattr(runner, name)))
        hidden_size = int(runner.model_config.get_hidden_size())
        if predictor is not None and predictor.input_dim != hidden_size:
            raise ValueError(
                f"predictor expects hidden size {predictor.input_dim}, the model has {hidden_size}"
            )
        return {"hidden_size": hidden_size, "predictor": predictor is not None}

    def _star_tap_watch(self, method: Any) -> Any:
        """``execute_model`` noting steps that schedule a new or resumed request.

        Only after such a step can a prompt complete (a migrated request on
        its target is a new request too), so on every other step that is not
        a round the tap does nothing at all. A scheduler output without the
        fields looked at counts as such a step (the tap then checks always).
        """

        def execute_model(scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
            try:
                if (
                    scheduler_output.scheduled_new_reqs
                    or scheduler_output.scheduled_cached_reqs.resumed_req_ids
                ):
                    self._star_tap.prefilling = True
            except AttributeError:
                self._star_tap.prefilling = True
            return method(scheduler_output, *args, **kwargs)

        return execute_model

    def _star_tap_step_timer(self, method: Any) -> Any:
        """``method`` adding its wall and thread CPU time to ``step_s``/``step_cpu_s`` under profile."""
        cpu = time.thread_time
        clock = time.perf_counter

        def timed(*args: Any, **kwargs: Any) -> Any:
            tap: _TapState = self._star_tap
            if not tap.profile:
                return method(*args, **kwargs)
            c0, t0 = cpu(), clock()
            try:
                return method(*args, **kwargs)
            finally:
                tap.step_s += clock() - t0
                tap.step_cpu_s += cpu() - c0

        return timed

    def _star_tap_first(self, rid: str) -> tuple[int, int, list[float] | None]:
        """(Most output tokens request ``rid`` can reach: max_tokens, and the model length;
        tokens it generated on other engines before, :data:`CONTINUED_KEY`; the fusion
        state it brings, :data:`FUSION_KEY`, or None)."""
        runner = self.model_runner
        req = runner.requests[rid]
        cap = int(runner.max_model_len) - int(req.num_prompt_tokens)
        params = req.sampling_params
        if params is not None and params.max_tokens is not None:
            cap = min(cap, int(params.max_tokens))
        extra = getattr(params, "extra_args", None) or {}
        fusion = extra.get(FUSION_KEY)
        carried = [float(x) for x in fusion] if isinstance(fusion, list | tuple) else None
        return cap, int(extra.get(CONTINUED_KEY) or 0), carried

    def _star_tap_take(self, tap: _TapState, hidden_states: Any) -> bool:
        """Take this step's rows if any are due; returns whether a round ran."""
        runner = self.model_runner
        batch = runner.input_batch
        n = batch.num_reqs
        if n == 0 or hidden_states.shape[0] < n:  # not the sampling call of a step
            return False
        discard = runner.discard_request_mask.np[:n]
        if tap.calls % tap.every:
            # Not a round: only requests whose prompt completes in this step
            # (their first row, zero tokens generated), found with one
            # vectorised comparison; a partial prefill (discarded) samples nothing.
            keep = batch.num_computed_tokens_cpu[:n] < batch.num_prompt_tokens[:n]
            if not keep.any():
                tap.prefilling = False  # nothing to look at until a new request comes
                return False
            keep &= ~discard
            return self._star_tap_round(tap, hidden_states, np.flatnonzero(keep), False)
        # A round: every request but a partial prefill's (usually all of them:
        # then slices, not copies).
        rows = np.flatnonzero(~discard) if discard.any() else None
        return self._star_tap_round(tap, hidden_states, rows, True)

    def _star_tap_round(self, tap: _TapState, hidden_states: Any, rows: Any, due: bool) -> bool:
        """One round on the rows ``rows`` of this step (None: all): predict, and/or collect."""
        batch = self.model_runner.input_batch
        n = batch.num_reqs
        req_ids = batch.req_ids
        if rows is None:
            # Tokens generated so far (the step's own token is not sampled yet).
            prompt = batch.num_prompt_tokens[:n]
            generated = batch.num_tokens_no_spec[:n] - prompt
            ids = req_ids[:n]
        elif len(rows) == 0:
            return False
        else:
            prompt = batch.num_prompt_tokens[rows]
            generated = batch.num_tokens_no_spec[rows] - prompt
            ids = [req_ids[i] for i in rows.tolist()]
        if tap.fast is not None:
            raw = tap.fast.raw_host(self._star_tap_rows(tap, hidden_states, n, rows))
            tap.book.fuse(due, ids, raw, generated, tap.fast, self._star_tap_first)
            tap.predict_batches += 1
            tap.predict_rows += len(ids)
        if tap.collect:
            import torch

            picked = _tensor_rows(hidden_states, n, rows)
            with torch.inference_mode():
                tap.hidden.append(picked.detach().float().cpu().clone())
            tap.samples.extend(zip(ids, prompt.tolist(), generated.tolist(), strict=True))
        return True

    @staticmethod
    def _star_tap_rows(tap: _TapState, hidden_states: Any, n: int, rows: Any) -> Any:
        """The round's rows of ``hidden_states`` (``rows`` None: the first ``n``) for the MLP.

        On the host a float32 array as a numpy view, sliced in numpy: right
        after the forward pass each torch call costs tens of microseconds
        (``star bench predictor --engine``). Otherwise (a GPU, bfloat16) a tensor.
        """
        if tap.as_numpy:
            try:
                array = hidden_states.numpy()
            except (TypeError, RuntimeError):  # not float32 on the host, or needs grad
                tap.as_numpy = False
            else:
                return array[:n] if rows is None else array[rows]
        return _tensor_rows(hidden_states, n, rows)

    def star_tap_predictions(self) -> dict[str, Any]:
        """The last prediction round: ``{"requests": {id: [R-hat, generated, weight, total]},
        timing...}`` (weight, total: the request's fusion state, :data:`FUSION_KEY`)."""
        tap: _TapState | None = getattr(self, "_star_tap", None)
        if tap is None:
            return {
                "requests": {},
                "predict_s": 0.0,
                "check_s": 0.0,
                "batches": 0,
                "rows": 0,
                "steps": 0,
            }
        return {
            "requests": tap.book.requests(),
            "predict_s": tap.predict_s,
            "check_s": tap.check_s,
            "tap_cpu_s": tap.tap_cpu_s,
            "step_cpu_s": tap.step_cpu_s,
            "step_s": tap.step_s,
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
