"""The tiny model's tokenizer: byte-level BPE trained on task text, ChatML template.

The pipeline is exactly Qwen2's (NFC, Qwen2's pre-tokenisation regex, byte-
level BPE, byte-level decoding): transformers 5 rebuilds that pipeline around
the vocabulary of every ``qwen2`` model whatever ``tokenizer.json`` says, and
vLLM loads tokenizers through transformers, so any other pipeline would
tokenise differently under vLLM than in training. Only the vocabulary and
merges are the project's, trained here on task text; each item label and
topic word is one token (see :func:`star.model.task.label`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from star.model import task

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS: tuple[str, ...] = (ENDOFTEXT, IM_START, IM_END)
"""Special tokens, with ids 0, 1, 2. ``<|im_end|>`` ends a turn and is the EOS."""

# Qwen2's pre-tokenisation regex (transformers' models/qwen2/tokenization_qwen2.py).
PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"""
    r"""| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

# ChatML as in Qwen2, without Qwen's default system prompt (the task has its
# own optional ones). Jinja whitespace control keeps the output byte-exact
# with render_chat() below.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- endif -%}"
)


def render_chat(messages: Sequence[dict[str, str]], add_generation_prompt: bool = True) -> str:
    """Render messages exactly as :data:`CHAT_TEMPLATE` does (no Jinja needed)."""
    text = "".join(f"{IM_START}{m['role']}\n{m['content']}{IM_END}\n" for m in messages)
    return text + f"{IM_START}assistant\n" if add_generation_prompt else text


def conversation_text(prompt: task.Prompt, answer: task.Answer) -> str:
    """A whole conversation as text, the answer closed by ``<|im_end|>``."""
    return render_chat(prompt.messages()) + answer.text() + IM_END


def token_id(tok: Tokenizer, token: str) -> int:
    """Id of a token that must exist (the specials, task words)."""
    tid = tok.token_to_id(token)
    if tid is None:
        raise KeyError(f"{token!r} is not in the vocabulary")
    return int(tid)


def single_token_strings() -> list[str]:
    """Strings that must each be exactly one token (the model's counting relies on it)."""
    words = [f" {w}" for t in task.TOPICS.values() for w in t.words]
    labels = [task.label(n) for n in range(1, task.N_MAX + 1)]
    return labels + words + [f" {s}" for s in task.SIZES]


def _corpus(seed: int, conversations: int) -> Iterable[str]:
    rng = np.random.default_rng(seed)
    for _ in range(conversations):
        prompt = task.sample_prompt(rng)
        yield conversation_text(prompt, task.sample_answer(prompt, rng))
    # Every label and word, often enough that BPE merges each into one token
    # even where sampled answers rarely reach it (large counts).
    coverage = "".join(f"{task.label(n)}. x\n" for n in range(1, task.N_MAX + 1)) + " ".join(
        s.strip() for s in single_token_strings()[task.N_MAX :]
    )
    for _ in range(50):
        yield coverage


def train_tokenizer(seed: int = 0, conversations: int = 2000, vocab_size: int = 2048) -> Tokenizer:
    """Train the byte-level BPE tokenizer on sampled task text.

    Raises ``RuntimeError`` when a label or word did not become one token
    (the vocabulary is too small for the task's N_MAX).
    """
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(seed, conversations), trainer=trainer)
    split = [s for s in single_token_strings() if len(tok.encode(s).ids) != 1]
    if split:
        raise RuntimeError(f"not single tokens with vocab_size={vocab_size}: {split[:10]}")
    return tok
