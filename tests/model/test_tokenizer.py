"""The shipped tokenizer: Qwen2-compatible, task tokens whole, template exact."""

from __future__ import annotations

import numpy as np
import pytest
from tokenizers import Tokenizer
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from star.model import task, tiny_model_path
from star.model.tokenizer import (
    CHAT_TEMPLATE,
    IM_END,
    SPECIAL_TOKENS,
    conversation_text,
    render_chat,
    single_token_strings,
    train_tokenizer,
)


@pytest.fixture(scope="module")
def raw() -> Tokenizer:
    return Tokenizer.from_file(str(tiny_model_path() / "tokenizer.json"))


@pytest.fixture(scope="module")
def hf() -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(tiny_model_path())


def _conversations(n: int, seed: int = 0) -> list[tuple[task.Prompt, task.Answer]]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        prompt = task.sample_prompt(rng)
        out.append((prompt, task.sample_answer(prompt, rng)))
    return out


def test_rebuild_gives_the_shipped_tokenizer(raw: Tokenizer) -> None:
    assert train_tokenizer(seed=0).to_str() == raw.to_str()


def test_specials_and_task_strings_are_single_tokens(raw: Tokenizer) -> None:
    assert [raw.token_to_id(t) for t in SPECIAL_TOKENS] == [0, 1, 2]
    for s in single_token_strings():
        assert len(raw.encode(s).ids) == 1, s


def test_transformers_tokenizes_like_the_trained_tokenizer(
    raw: Tokenizer, hf: PreTrainedTokenizerBase
) -> None:
    # transformers 5 rebuilds Qwen2's pipeline around the vocabulary (and vLLM
    # loads through transformers): it must agree with ours id for id.
    assert hf.eos_token == IM_END
    for prompt, answer in _conversations(50):
        text = conversation_text(prompt, answer)
        assert hf.encode(text, add_special_tokens=True) == raw.encode(text).ids
    odd = "Ünïcödé 123 tabs\tand  spaces\r\n<|im_start|>x"
    assert hf.encode(odd) == raw.encode(odd).ids


def test_round_trip_and_answer_token_count(raw: Tokenizer) -> None:
    for prompt, answer in _conversations(50, seed=1):
        text = conversation_text(prompt, answer)
        ids = raw.encode(text).ids
        assert raw.decode(ids, skip_special_tokens=False) == text
        prompt_ids = raw.encode(render_chat(prompt.messages())).ids
        answer_ids = raw.encode(answer.text()).ids
        # The prompt tokenises the same alone as in the whole conversation,
        # so training sequences match what an engine sees.
        assert ids == [*prompt_ids, *answer_ids, raw.token_to_id(IM_END)]
        assert len(answer_ids) + 1 == answer.num_tokens()


def test_chat_template_matches_render_chat(hf: PreTrainedTokenizerBase) -> None:
    assert hf.chat_template == CHAT_TEMPLATE
    for prompt, _ in _conversations(10, seed=2):
        for gen in (True, False):
            text = hf.apply_chat_template(
                prompt.messages(), tokenize=False, add_generation_prompt=gen
            )
            assert text == render_chat(prompt.messages(), add_generation_prompt=gen)
