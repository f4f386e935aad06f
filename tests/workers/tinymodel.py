"""A random-init 2-layer, 128-wide Qwen2 model with its tokenizer, for engine tests.

Stands in for the project's trained demo model (``star.model.tiny_model_path()``)
while that is not built. Weights are random but fixed (seeded) and scaled up so
greedy decoding has clear argmax margins: a P->D handoff must reproduce a
single-engine run token for token, and near-ties would make that flaky.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

VOCAB_SIZE = 384


def build(out: Path) -> Path:
    """Write the model directory ``out`` (config, safetensors, tokenizer) and return it."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch/transformers import-time deprecations
        import torch
        from tokenizers import ByteLevelBPETokenizer
        from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    out.mkdir(parents=True, exist_ok=True)
    corpus = [f"the quick brown fox jumps over the lazy dog {i}" for i in range(200)]
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(
        corpus, vocab_size=VOCAB_SIZE, min_frequency=1, special_tokens=["<|endoftext|>"]
    )
    tok = PreTrainedTokenizerFast(
        tokenizer_object=bpe._tokenizer, eos_token="<|endoftext|>", pad_token="<|endoftext|>"
    )
    tok.save_pretrained(out)
    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=VOCAB_SIZE,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        eos_token_id=tok.eos_token_id,
        bos_token_id=tok.eos_token_id,
        tie_word_embeddings=False,
        initializer_range=0.2,
    )
    Qwen2ForCausalLM(config).save_pretrained(out, safe_serialization=True)
    return out


def vocab_size(model_dir: Path) -> int:
    """The vocabulary size in a model directory's config.json."""
    return int(json.loads((model_dir / "config.json").read_text())["vocab_size"])
