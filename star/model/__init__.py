"""The project's tiny demo model: a 2-layer Qwen2 trained on a synthetic task.

``tiny_model_path()`` is a Hugging Face model directory shipped with the
package (float32 weights, byte-level BPE tokenizer, ChatML chat template);
vLLM and ``transformers`` load it by path like any downloaded model. The
task (:mod:`star.model.task`) makes answer lengths depend on the prompt and
on sampling, so the length predictor has something real to learn; ``star
model train-tiny`` rebuilds the weights (:mod:`star.model.build`).

This package imports neither torch nor transformers until a submodule that
needs them is imported.
"""

from __future__ import annotations

from pathlib import Path

_TINY_DIR = Path(__file__).resolve().parent / "tiny"


def tiny_model_path() -> Path:
    """Directory of the shipped tiny model (pass it as vLLM's ``model``)."""
    return _TINY_DIR


__all__ = ["tiny_model_path"]
