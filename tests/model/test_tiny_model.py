"""The shipped model loads with transformers and does the task under greedy decoding."""

from __future__ import annotations

import json

import pytest
from transformers import PreTrainedTokenizerBase, Qwen2ForCausalLM

from star.model import task, tiny_model_path
from star.model.build import BUILD_INFO
from star.model.evaluate import generate, load
from star.model.export import weights_digest
from star.model.tokenizer import IM_END


@pytest.fixture(scope="module")
def model() -> tuple[Qwen2ForCausalLM, PreTrainedTokenizerBase]:
    return load(tiny_model_path())


def test_shipped_files_are_small_and_recorded() -> None:
    path = tiny_model_path()
    names = {p.name for p in path.iterdir()}
    assert {
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
        BUILD_INFO,
    } <= names
    assert sum(p.stat().st_size for p in path.iterdir()) < 10 * 2**20
    info = json.loads((path / BUILD_INFO).read_text())
    assert info["weights_sha256"] == weights_digest(path)


def test_config_is_a_tiny_qwen2(model: tuple[Qwen2ForCausalLM, PreTrainedTokenizerBase]) -> None:
    m, tok = model
    cfg = m.config
    assert cfg.architectures == ["Qwen2ForCausalLM"] and cfg.model_type == "qwen2"
    assert (cfg.num_hidden_layers, cfg.hidden_size) == (2, 128)
    assert cfg.vocab_size >= len(tok)
    assert sum(p.numel() for p in m.parameters()) < 2_000_000
    assert tok.convert_tokens_to_ids(IM_END) in m.generation_config.eos_token_id


# Short answers (tiny, short, medium) keep this test to seconds.
PROMPTS = [
    task.Prompt("animals", "tiny", "owl"),
    task.Prompt("fruits", "short", "plum", template=1),
    task.Prompt("colors", "short", template=2),
    task.Prompt("metals", "medium", "tin", template=3),
    task.Prompt("cities", "medium", "oslo"),
]


def test_greedy_answers_are_valid_distinct_and_terminate(
    model: tuple[Qwen2ForCausalLM, PreTrainedTokenizerBase],
) -> None:
    m, tok = model
    eos = tok.convert_tokens_to_ids(IM_END)
    texts = []
    for prompt in PROMPTS:
        ids = generate(m, tok, prompt, max_new_tokens=400)[0]
        assert ids[-1] == eos, f"{prompt.user_text()!r} did not terminate"
        text = tok.decode(ids, skip_special_tokens=True)
        check = task.check_answer(prompt, text)
        assert check.ok, (prompt.user_text(), check.errors, text)
        texts.append(text)
    assert len(set(texts)) == len(texts)
    # Length follows the size word.
    items = [task.check_answer(p, t).count for p, t in zip(PROMPTS, texts, strict=True)]
    assert items[0] < min(items[1:3]) and max(items[1:3]) < min(items[3:])


def test_sampled_lengths_vary(model: tuple[Qwen2ForCausalLM, PreTrainedTokenizerBase]) -> None:
    m, tok = model
    prompt = task.Prompt("trees", "short", "elm")
    answers = generate(m, tok, prompt, n=16, greedy=False, seed=0, max_new_tokens=400)
    assert len({len(a) for a in answers}) >= 4
