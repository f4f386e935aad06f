"""Write the tiny model as a Hugging Face model directory that vLLM loads as is.

Files: ``config.json``, ``generation_config.json``, ``model.safetensors``
(float32), ``tokenizer.json``, ``tokenizer_config.json`` (with the chat
template) and ``special_tokens_map.json``.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer
from transformers import GenerationConfig, Qwen2ForCausalLM

from star.model.tokenizer import (
    CHAT_TEMPLATE,
    ENDOFTEXT,
    IM_END,
    IM_START,
    SPECIAL_TOKENS,
    token_id,
)

WEIGHTS = "model.safetensors"


def _write_json(path: Path, obj: dict[str, Any]) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n")


def tokenizer_config(tok: Tokenizer, max_length: int) -> dict[str, Any]:
    """``tokenizer_config.json``: the generic fast tokenizer, ChatML specials, the template.

    ``PreTrainedTokenizerFast`` and not ``Qwen2Tokenizer``: transformers 5's
    Qwen2 class rebuilds Qwen's own pre-tokenizer (one digit per token),
    which is not the one this vocabulary was trained with.
    """
    added = {
        str(token_id(tok, t)): {
            "content": t,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for t in SPECIAL_TOKENS
    }
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": added,
        "additional_special_tokens": [IM_START, IM_END],
        "bos_token": None,
        "eos_token": IM_END,
        "pad_token": ENDOFTEXT,
        "unk_token": None,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "model_max_length": max_length,
        "split_special_tokens": False,
    }


def export(model: Qwen2ForCausalLM, tok: Tokenizer, out: Path) -> Path:
    """Save model and tokenizer into ``out`` (created); returns ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    end_ids = [token_id(tok, IM_END), token_id(tok, ENDOFTEXT)]
    # No sampling defaults: vLLM adopts generation_config's temperature/top_k
    # as request defaults, and the task's length distribution is the model's
    # distribution at temperature 1 with no truncation.
    model.generation_config = GenerationConfig(  # type: ignore[no-untyped-call]
        bos_token_id=None, eos_token_id=end_ids, pad_token_id=token_id(tok, ENDOFTEXT)
    )
    model.save_pretrained(out)
    tok.save(str(out / "tokenizer.json"))
    _write_json(
        out / "tokenizer_config.json", tokenizer_config(tok, model.config.max_position_embeddings)
    )
    _write_json(
        out / "special_tokens_map.json",
        {
            "additional_special_tokens": [IM_START, IM_END],
            "eos_token": IM_END,
            "pad_token": ENDOFTEXT,
        },
    )
    return out


def weights_digest(model_dir: Path) -> str:
    """SHA-256 of the weights file, to tell whether a rebuild reproduced the shipped model."""
    return hashlib.sha256((model_dir / WEIGHTS).read_bytes()).hexdigest()
