"""The shipped tiny model with the markup tokens of reasoning and tool-call formats.

DeepSeek-R1's ``<think>`` / ``</think>`` and Hermes' ``<tool_call>`` /
``</tool_call>`` are added to the tokenizer as those models have them (ids
913-916, inside the model's 960-row embedding), so vLLM's reasoning and
tool-call parsers (``proxy.reasoning_parser=deepseek_r1``,
``proxy.tool_call_parser=hermes``) accept it, and an engine runs it when the
weights are copied too. The weights are the shipped ones: the model never
writes a markup token by itself. ``star bench conformance --reasoning-parser``
and the tests serve it.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from star.model import tiny_model_path

MARKUP = ["<think>", "</think>", "<tool_call>", "</tool_call>"]
THINK_END = 914
"""``</think>``'s id in the marked-up tokenizer."""
_TOKENIZER_FILES = ("tokenizer_config.json", "special_tokens_map.json", "config.json")
_MODEL_FILES = ("generation_config.json", "model.safetensors")


def markup_model(root: Path, *, weights: bool = False) -> Path:
    """Write the marked-up model directory at ``root`` (tokenizer only, or runnable with ``weights``)."""
    from tokenizers import Tokenizer

    src = tiny_model_path()
    root.mkdir(parents=True, exist_ok=True)
    for name in _TOKENIZER_FILES + (_MODEL_FILES if weights else ()):
        shutil.copy(src / name, root / name)
    tok = Tokenizer.from_file(str(src / "tokenizer.json"))
    tok.add_tokens(MARKUP)
    if tok.token_to_id("</think>") != THINK_END:  # the shipped tokenizer changed
        raise RuntimeError(f"</think> is {tok.token_to_id('</think>')}, not {THINK_END}")
    tok.save(str(root / "tokenizer.json"))
    config = json.loads((src / "tokenizer_config.json").read_text())
    for token in MARKUP:  # transformers reads its added tokens from here
        config["added_tokens_decoder"][str(tok.token_to_id(token))] = {
            "content": token,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": False,
        }
    (root / "tokenizer_config.json").write_text(json.dumps(config))
    return root
