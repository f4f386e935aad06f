"""Run the tiny model with ``transformers`` and measure it against the task.

The reference implementation for checks (vLLM's output is compared with
it) and the source of the length tables in ``docs/tiny-model.md``.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, cast

import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedTokenizerBase,
    Qwen2ForCausalLM,
)

from star.model import task
from star.model.tokenizer import render_chat


def load(path: Path) -> tuple[Qwen2ForCausalLM, PreTrainedTokenizerBase]:
    """Load model (float32, eval mode) and tokenizer from a model directory."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.eval()  # type: ignore[no-untyped-call]
    tok = AutoTokenizer.from_pretrained(path)
    if not isinstance(model, Qwen2ForCausalLM):
        raise TypeError(f"{path} holds a {type(model).__name__}, not a Qwen2ForCausalLM")
    return model, tok


def decode(tok: PreTrainedTokenizerBase, ids: Sequence[int]) -> str:
    """Answer text of generated ids, without the end token."""
    text = tok.decode(list(ids), skip_special_tokens=True)
    assert isinstance(text, str)  # one sequence in, one string out
    return text


@torch.inference_mode()
def generate(
    model: Qwen2ForCausalLM,
    tok: PreTrainedTokenizerBase,
    prompt: task.Prompt,
    *,
    n: int = 1,
    greedy: bool = True,
    seed: int = 0,
    max_new_tokens: int = 2048,
) -> list[list[int]]:
    """Generate ``n`` answers; each is its token ids up to and including the end token.

    Sampling is plain temperature 1 over the whole vocabulary (no top-k or
    top-p), which is what the task's length distribution describes.
    """
    ids = tok(render_chat(prompt.messages()), return_tensors="pt").input_ids
    torch.manual_seed(seed)
    out = cast(Any, model).generate(  # transformers' own annotation rejects the subclass
        ids.repeat(n, 1),
        attention_mask=torch.ones(n, ids.shape[1], dtype=torch.long),
        do_sample=not greedy,
        temperature=None if greedy else 1.0,
        top_k=None if greedy else 0,
        top_p=None,
        max_new_tokens=max_new_tokens,
    )
    eos = set(model.generation_config.eos_token_id)
    answers = []
    for row in out[:, ids.shape[1] :].tolist():
        end = next((i + 1 for i, t in enumerate(row) if t in eos), len(row))
        answers.append(row[:end])
    return answers
