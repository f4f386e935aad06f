"""A migrated request resumed as a true continuation, on the worker side (docs/design.md §5.2).

A continuation reaches the engine as its original prompt with the tokens it
generated elsewhere in ``SamplingParams.extra_args[RESUME_KEY]``;
:class:`workers.vllm_ext.StarScheduler` makes them the request's output
tokens. vLLM 0.32's V1 model runner (the CPU one; on a GPU, where model
runner V2 is off or unsupported) does not take them from the scheduler: a
new request starts with ``output_token_ids=[]`` and a generator seeded
afresh. :func:`install` wraps the runner's ``input_batch.add_request`` so
that a resumed request enters the batch with those tokens as outputs (input
ids, penalties, ``bad_words`` and ``min_tokens`` read them) and its seeded
generator skipped ahead by one draw per token generated (:func:`skip`), as
the source's was. :func:`skip_matches_sampler` checks at
install, on the runner's device and with its vocabulary, that a step of the
runner's own sampler draws exactly what :func:`skip` skips; where it does not,
seeded requests stay non-migratable. Measured on an H200
(docs/measured/gpu-continuation-h200.txt): on CUDA the skip matches while
the vocabulary fits one Philox call per thread of the device's grid.
"""

from __future__ import annotations

import os
from typing import Any

import structlog
import torch

log = structlog.get_logger(__name__)

NO_HOOK_ENV = "STAR_TEST_NO_RESUME_HOOK"
"""Set to 1, the hook is installed but does nothing: the exactness tests' negative control."""

RESUME_KEY = "star_resume"
"""``SamplingParams.extra_args`` key: the tokens a continued request generated before this leg."""


def resume_tokens(sampling_params: Any) -> list[int]:
    """The tokens a request resumes after (empty for a plain request)."""
    extra = getattr(sampling_params, "extra_args", None) or {}
    return [int(t) for t in extra.get(RESUME_KEY) or ()]


def skip(generator: torch.Generator, draws: int) -> None:
    """Advance ``generator`` by ``draws`` sampler steps of one seeded row each.

    vLLM 0.32's CPU sampler (``TopKTopPSampler.forward_cpu``) draws one
    ``randint(0, 2**31, (1,))`` per seeded row per step. On a CUDA generator
    the same draw advances the Philox offset by 4, as one step of the V1 GPU
    sampler (``q[i].exponential_``) does for a vocabulary up to four values
    per thread of the device's grid (vLLM rewinds a discarded step by 4);
    :func:`skip_matches_sampler` checks it for the engine's device and
    vocabulary (docs/measured/gpu-continuation-*.txt).
    """
    for _ in range(draws):
        torch.randint(
            0, 2**31, (1,), generator=generator, dtype=torch.long, device=generator.device
        )


def skip_matches_sampler(
    sampler: Any, vocab: int = 64, steps: int = 3, device: Any = "cpu"
) -> bool:
    """Whether ``steps`` calls of ``sampler`` (vLLM's TopKTopPSampler) draw what :func:`skip` skips.

    Run on the engine's ``device`` with its ``vocab``: a request's generator
    lives there (the V1 GPU runner seeds a CUDA generator), and on CUDA how
    far one step's noise advances it depends on the vocabulary's size.
    """
    stepped, skipped = torch.Generator(device=device), torch.Generator(device=device)
    stepped.manual_seed(1234)
    skipped.manual_seed(1234)
    logits = torch.linspace(-1.0, 1.0, vocab, dtype=torch.float32, device=device).unsqueeze(0)
    try:
        for _ in range(steps):
            sampler(logits.clone(), {0: stepped}, None, None)
        skip(skipped, steps)
    except Exception as exc:  # a sampler or device this check cannot drive: not proven
        log.warning("seeded_skip_check_failed", error=f"{type(exc).__name__}: {exc}")
        return False
    return bool(torch.equal(stepped.get_state(), skipped.get_state()))


class _Resumer:
    """Wraps one ``InputBatch.add_request``: a resumed request enters with its outputs."""

    def __init__(self, runner: Any, seeded: bool) -> None:
        self.runner = runner
        self.seeded = seeded
        self.enabled = True  # False: the negative control (tests), the hook does nothing
        self.done: set[str] = set()  # request ids already resumed (add_request runs again)

    def wrap(self, batch: Any) -> None:
        if getattr(batch, "_star_resumer", None) is self:
            return
        add_request = batch.add_request

        def _add_request(request: Any) -> int:
            if self.enabled and request.req_id not in self.done:
                tokens = resume_tokens(request.sampling_params)
                if tokens:
                    self.done.add(request.req_id)
                    if not request.output_token_ids:
                        request.output_token_ids.extend(tokens)
                        if request.generator is not None and self.seeded:
                            skip(request.generator, len(tokens))
            return int(add_request(request))

        batch.add_request = _add_request
        batch._star_resumer = self

    def forget(self, finished: Any) -> None:
        for rid in finished or ():
            self.done.discard(rid)


def install(runner: Any) -> dict[str, bool]:
    """Resume continuations on ``runner`` (a vLLM V1 model runner); idempotent.

    Returns ``{"installed": ..., "seeded": ...}``: whether the runner needed
    and got the hook, and whether seeded requests continue exactly on it.
    A runner without an ``input_batch`` (vLLM's model runner V2, the GPU
    default) builds its state from the scheduler's token list and needs
    nothing (docs/design.md §5.2); its seeded noise depends on positions only.
    """
    resumer = getattr(runner, "_star_resumer", None)
    if resumer is not None:
        return {"installed": True, "seeded": resumer.seeded}
    if not hasattr(runner, "input_batch") or not hasattr(runner, "_update_states"):
        return {"installed": False, "seeded": True}
    sampler = getattr(getattr(runner, "sampler", None), "topk_topp_sampler", None)
    vocab = int(getattr(runner.input_batch, "vocab_size", 0) or 64)
    device = getattr(runner, "device", None) or "cpu"
    seeded = sampler is not None and skip_matches_sampler(sampler, vocab=vocab, device=device)
    if not seeded:
        log.warning(
            "seeded_requests_not_migratable",
            reason="one step of this engine's sampler does not draw what the skip-ahead skips",
        )
    resumer = _Resumer(runner, seeded)
    if os.environ.get(NO_HOOK_ENV) == "1":
        resumer.enabled = False
        log.warning("resume_hook_disabled", env=NO_HOOK_ENV)
    resumer.wrap(runner.input_batch)
    update_states = runner._update_states

    def _update_states(scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
        resumer.wrap(runner.input_batch)  # a rebuilt batch is wrapped again
        resumer.forget(getattr(scheduler_output, "finished_req_ids", None))
        return update_states(scheduler_output, *args, **kwargs)

    runner._update_states = _update_states
    runner._star_resumer = resumer
    return {"installed": True, "seeded": seeded}


class Continuation:
    """Worker-extension methods (prefixed ``star_continuation_``)."""

    model_runner: Any  # provided by vLLM's worker class

    def star_continuation_install(self) -> dict[str, bool]:
        """:func:`install` on this worker's runner."""
        return install(self.model_runner)

    def star_continuation_enable(self, enabled: bool) -> bool:
        """Turn the hook on or off (off: the negative control of the exactness tests)."""
        resumer = getattr(self.model_runner, "_star_resumer", None)
        if resumer is None:
            return False
        resumer.enabled = bool(enabled)
        return True
