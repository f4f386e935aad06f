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
one batch (:class:`star.predictor.model.FastPredictor`: a few ``addmm`` calls,
no copy of the rows when every request is decoding) and serves, per request,
R-hat = T - generated, where T is the request's predicted final length
R-hat_i + generated_i fused over its rounds, each round weighted by the
MLP's own error scale (:func:`star.predictor.model.fuse_step`, ``decay`` and
``power`` from the checkpoint), and never more than the request can still
produce: R-hat <= min(max_tokens, max_model_len - prompt) - generated, a hard
bound the worker knows (``star_tap_predictions``). In collection mode it keeps
the hidden states themselves (``star_tap_drain``). With neither, the wrapper
does nothing but count steps.

The predictor's time is measured inside the wrapper: the rounds
(``predict_s``) and the one comparison on the other steps (``check_s``), in
wall-clock time. With ``profile`` (``star bench predictor --engine``) the tap
also times every model step in the worker (``execute_model`` +
``sample_tokens``, which contain it), in wall-clock and in the thread's CPU
time, and counts its own CPU time: ratios measured in one process, the CPU
one not inflated by a machine shared with other work.

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

import numpy as np
import structlog

log = structlog.get_logger(__name__)

QUALNAME = "workers.tap.HiddenStateTap"

_NONE = np.zeros(0)  # fuse_round's per-row arrays for new requests, in a round without any

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


def external_id(internal: str) -> str:
    """The caller's request id of a vLLM internal id (``<external>-<8 chars>``)."""
    head, sep, tail = internal.rpartition("-")
    return head if sep and len(tail) == 8 else internal


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
        self.decay = float(predictor.config.decay) if predictor is not None else 0.0
        self.power = float(predictor.config.power) if predictor is not None else 0.0
        self.first_weight = float(predictor.config.first_weight) if predictor is not None else 1.0
        self.collect = collect
        # Whether the rows can be read as a numpy view (float32 on the host;
        # found out on the first round).
        self.as_numpy = self.fast is not None and self.fast.host
        self.active = predictor is not None or collect
        self.calls = 0
        # Set by the step watcher when a step schedules a new or resumed
        # request; cleared by a check that finds no prompt left to complete.
        self.prefilling = True
        # Per request, in the order of ``slot``: fuse_step's state (sum of
        # weights, sum of weighted final lengths), its cap (most output tokens
        # it may still reach), the R-hat served and the tokens generated then.
        self.slot: dict[str, int] = {}
        # Requests continued here after a handoff: tokens generated before (their
        # final lengths here are counted from the continuation's prompt).
        self.moved: dict[str, int] = {}
        self.weight = np.zeros(0)
        self.total = np.zeros(0)
        self.cap = np.zeros(0)
        self.served = np.zeros(0)
        self.generated = np.zeros(0)
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
            self._star_tap_serve(tap, due, ids, raw, generated)
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

    def _star_tap_serve(
        self,
        tap: _TapState,
        due: bool,
        ids: list[str],
        raw: Any,
        generated: Any,
    ) -> None:
        """Fuse one round into each request's served R-hat (hard-bounded by its cap).

        :func:`star.predictor.kernels.fuse_round` decodes the MLP's raw
        outputs and runs :func:`star.predictor.model.fuse_step` on every row
        in one compiled call; the fusion state is kept per request in arrays
        (one dictionary lookup per row).
        """
        from star.predictor.kernels import fuse_round

        fast = tap.fast
        assert fast is not None
        slot = tap.slot
        found = [slot.get(rid, -1) for rid in ids]
        at = np.array(found, dtype=np.intp)
        any_new = -1 in found
        weight0, total0, cap0, from_at = tap.weight, tap.total, tap.cap, at
        if any_new:  # a request's first round: its prompt's row, unless it was moved here
            fresh = np.flatnonzero(at < 0)
            first = np.ones(len(ids))
            fresh_cap = np.zeros(len(ids))
            carried: list[tuple[int, int, list[float]]] = []  # (row, cap, fusion state)
            for i in fresh.tolist():
                cap_i, before, fusion = self._star_tap_first(ids[i])
                fresh_cap[i] = cap_i
                if not before:
                    first[i] = tap.first_weight
                    continue
                tap.moved[ids[i]] = before
                if fusion is not None and len(fusion) == 2:
                    # Final lengths here count from the continuation's prompt.
                    carried.append((i, cap_i, [fusion[0], fusion[1] - before * fusion[0]]))
            if carried:
                # Rows that bring a fusion state continue it, as known rows do.
                base = len(tap.weight)
                from_at = at.copy()
                from_at[[i for i, _, _ in carried]] = np.arange(base, base + len(carried))
                weight0 = np.concatenate([tap.weight, [w for _, _, (w, _) in carried]])
                total0 = np.concatenate([tap.total, [t for _, _, (_, t) in carried]])
                cap0 = np.concatenate([tap.cap, [float(c) for _, c, _ in carried]])
        else:
            first = fresh_cap = _NONE
        g = generated.astype(np.float64)
        weight, total, cap, served = fuse_round(
            raw,
            fast.log_target,
            fast.uncertainty,
            fast.scale,
            from_at,
            first,
            fresh_cap,
            g,
            weight0,
            total0,
            cap0,
            tap.decay,
            tap.power,
        )
        if due:
            # A round holds every running request: finished ones are forgotten.
            tap.slot = dict(zip(ids, range(len(ids)), strict=True))
            if tap.moved:
                tap.moved = {rid: n for rid, n in tap.moved.items() if rid in tap.slot}
            tap.weight, tap.total, tap.cap, tap.served, tap.generated = (
                weight,
                total,
                cap,
                served,
                g,
            )
            return
        # A prompt-completion round: update the known requests, append the new.
        new = at < 0
        known = at[~new]
        for name, value in (
            ("weight", weight),
            ("total", total),
            ("cap", cap),
            ("served", served),
            ("generated", g),
        ):
            column = getattr(tap, name)
            column[known] = value[~new]
            if any_new:
                setattr(tap, name, np.concatenate([column, value[new]]))
        if any_new:
            base = len(slot)
            for k, i in enumerate(np.flatnonzero(new).tolist()):
                slot[ids[i]] = base + k

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
        moved = tap.moved
        return {
            # [R-hat, generated, and the fusion state to hand over with the request
            # (FUSION_KEY): sum of weights, sum of weighted final lengths counted
            # from the original prompt]
            "requests": {
                rid: [
                    float(tap.served[i]),
                    int(tap.generated[i]),
                    float(tap.weight[i]),
                    float(tap.total[i] + moved.get(rid, 0) * tap.weight[i]),
                ]
                for rid, i in tap.slot.items()
            },
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


# -- the front-end side -------------------------------------------------------------------


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
