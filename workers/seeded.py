"""Seeded sampling that survives a chunked prefill on a CPU engine.

vLLM samples every request of a step, also one whose prompt is only partly
prefilled, then drops that token and rewinds the request's generator by one
draw: ``gen.set_offset(gen.get_offset() - 4)`` in
``GPUModelRunner._bookkeeping_sync``, a Philox offset. The CPU runner inherits
that code, but a CPU ``torch.Generator`` (Mersenne Twister) has no offset and
raises "CPU Generator does not use offset", which kills the engine core: any
request with ``seed`` and a prompt longer than one step's token budget took
the engine, and every request on it, down.

:class:`RewindableGenerator` gives a CPU generator the one offset operation
vLLM uses, exactly: its state is saved before a step's draw
(:func:`install`'s wrapper of ``_sample``, for the requests vLLM will
discard) and put back when vLLM rewinds. A seeded request then samples the
same tokens however its prompt was split into chunks, as on a GPU.
"""

from __future__ import annotations

from typing import Any

import structlog
import torch

log = structlog.get_logger(__name__)

DRAW = 4
"""What vLLM subtracts from the offset to undo one step's draw (Philox counts 4 per draw)."""


class RewindableGenerator(torch.Generator):
    """A CPU generator whose last checkpointed draw can be undone with ``set_offset``.

    ``get_offset`` counts checkpoints (``DRAW`` each); ``set_offset`` accepts
    one value, the offset before the last checkpoint, and restores the state
    saved there. Any other offset is refused: this generator cannot seek.
    """

    def __init__(self) -> None:
        super().__init__()  # torch.Generator.__new__ made a CPU generator
        self._offset = 0
        self._saved: torch.Tensor | None = None

    @classmethod
    def replacing(cls, generator: torch.Generator) -> RewindableGenerator:
        """A rewindable generator in ``generator``'s state (its draws continue unchanged)."""
        new = cls()
        new.set_state(generator.get_state())
        return new

    def checkpoint(self) -> None:
        """Save the state before a draw that may be undone."""
        self._saved = self.get_state()
        self._offset += DRAW

    def get_offset(self) -> int:
        return self._offset

    def set_offset(self, offset: int) -> torch.Generator:
        if self._saved is None or offset != self._offset - DRAW:
            raise RuntimeError(
                f"a CPU generator can only undo its last checkpointed draw "
                f"(offset {self._offset} -> {self._offset - DRAW}), not seek to {offset}"
            )
        self.set_state(self._saved)
        self._saved = None
        self._offset = offset
        return self


def install(runner: Any) -> bool:
    """Make seeded requests on ``runner`` (a vLLM model runner) safe to chunk; True if it changed.

    Only a CPU runner needs it (a CUDA generator has offsets). Wraps two of
    the runner's methods on the instance: ``_update_states`` swaps each new
    request's CPU generator for a :class:`RewindableGenerator` in the same
    state, and ``_sample`` checkpoints the generators of the requests this
    step will discard. Installing twice changes nothing.
    """
    device = getattr(runner, "device", None)
    if device is None or torch.device(device).type != "cpu":
        return False
    if getattr(runner, "_star_seeded", False):
        return True
    runner._star_seeded = True
    update_states, sample = runner._update_states, runner._sample

    def _update_states(scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
        out = update_states(scheduler_output, *args, **kwargs)
        batch = runner.input_batch
        for new in scheduler_output.scheduled_new_reqs:
            state = runner.requests.get(new.req_id)
            if state is None or state.generator is None:
                continue
            if isinstance(state.generator, RewindableGenerator):
                continue  # a streaming update of a request already swapped
            state.generator = RewindableGenerator.replacing(state.generator)
            index = batch.req_id_to_index.get(new.req_id)
            if index is not None and index in batch.generators:
                batch.generators[index] = state.generator
        return out

    def _sample(*args: Any, **kwargs: Any) -> Any:
        batch = runner.input_batch
        if batch.generators:
            discard = runner.discard_request_mask.np[: batch.num_reqs]
            for index, generator in batch.generators.items():
                if discard[index] and isinstance(generator, RewindableGenerator):
                    generator.checkpoint()
        return sample(*args, **kwargs)

    runner._update_states = _update_states
    runner._sample = _sample
    return True


class SeededSampling:
    """Worker-extension method (prefixed ``star_seeded_``), called once at engine start."""

    model_runner: Any  # provided by vLLM's worker class

    def star_seeded_install(self) -> bool:
        """:func:`install` on this worker's runner; True where it was needed (CPU)."""
        return install(self.model_runner)
