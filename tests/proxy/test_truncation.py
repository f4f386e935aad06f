"""``truncate_prompt_tokens`` / ``truncation_side`` / ``add_special_tokens`` (issue 28): the
prompt vLLM's renderer makes.

The reference is vLLM 0.32's own pipeline run in process on the same
tokenizer: ``TokenizeParams.apply_pre_tokenization``, the Hugging Face
tokenizer called with ``get_encode_kwargs()`` (as ``Renderer._tokenize_prompt``
calls it; vLLM's ``get_tokenizer`` sets ``truncation_side="left"`` for a
generative model), then ``apply_post_tokenization``. On the shipped tiny model
(no special tokens added) and on a copy whose tokenizer adds a BOS token, so
that the tokenizer's own truncation (special tokens kept) is exercised.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from proxy.http import HttpError
from proxy.openai import ParsedRequest, parse_chat, parse_completion
from proxy.tokenizer import ModelCard
from star.model import tiny_model_path

MODEL = "tiny"
WORDS = ["owl", " cat", " hé", "llo", " 你好", "!", "\n", " the", "🙂", " 42"]

pytestmark = [
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
]


def _with_bos(root: Path) -> Path:
    """A copy of the tiny model whose tokenizer puts ``<|im_start|>`` before every text."""
    shutil.copytree(tiny_model_path(), root, ignore=shutil.ignore_patterns("*.safetensors"))
    path = root / "tokenizer.json"
    doc = json.loads(path.read_text())
    doc["post_processor"] = {
        "type": "TemplateProcessing",
        "single": [
            {"SpecialToken": {"id": "<|im_start|>", "type_id": 0}},
            {"Sequence": {"id": "A", "type_id": 0}},
        ],
        "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {
            "<|im_start|>": {"id": "<|im_start|>", "ids": [1], "tokens": ["<|im_start|>"]}
        },
    }
    path.write_text(json.dumps(doc))
    return root


@pytest.fixture(scope="module", params=["tiny", "bos"])
def model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """(card, vLLM's tokenizer) of one model directory."""
    from vllm.tokenizers import get_tokenizer

    root = (
        tiny_model_path()
        if request.param == "tiny"
        else _with_bos(tmp_path_factory.mktemp("m") / "bos")
    )
    card = ModelCard.load(root, name=MODEL)
    return card, get_tokenizer(str(root))


def vllm_prompt(
    tok: Any,
    card: ModelCard,
    prompt: str | list[int],
    keep: int | None,
    side: str | None,
    special: bool,
) -> list[int]:
    """The prompt ids vLLM 0.32's renderer gives (its ``TokenizeParams`` pipeline)."""
    from vllm.renderers.params import TokenizeParams

    params = TokenizeParams(
        max_total_tokens=card.max_model_len,
        max_output_tokens=16,
        truncate_prompt_tokens=keep,
        truncation_side=side,  # type: ignore[arg-type]
        add_special_tokens=special,
        max_total_tokens_param="max_model_len",
    )
    if isinstance(prompt, str):
        text = params.apply_pre_tokenization(tok, {"prompt": prompt})["prompt"]
        ids = tok(text, **params.get_encode_kwargs())["input_ids"]
    else:
        ids = list(prompt)
    out = params.apply_post_tokenization(tok, {"prompt_token_ids": ids})
    return list(out["prompt_token_ids"])


def _completion(card: ModelCard, **kw: Any) -> ParsedRequest:
    body = json.dumps({"model": MODEL, "max_tokens": 16, **kw}).encode()
    return parse_completion(body, {MODEL: card})


_TEXT = st.lists(st.sampled_from(WORDS), min_size=1, max_size=30).map("".join)
_KEEP = st.sampled_from([-1, 1, 2, 3, 5, 8, 20, 64])
_SIDE = st.sampled_from([None, "left", "right"])


@settings(
    max_examples=80,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(text=_TEXT, keep=_KEEP | st.none(), side=_SIDE, as_ids=st.booleans(), special=st.booleans())
def test_a_completion_prompt_is_truncated_as_vllm_truncates_it(
    model: Any, text: str, keep: int | None, side: str | None, as_ids: bool, special: bool
) -> None:
    """``special``: add_special_tokens (completions: true by default); ``keep`` None: no
    truncation."""
    card, tok = model
    prompt: str | list[int] = card.encode(text) if as_ids else text
    fields: dict[str, Any] = {"prompt": prompt, "truncate_prompt_tokens": keep}
    fields |= {"add_special_tokens": special} | ({"truncation_side": side} if side else {})
    got = _completion(card, **fields).gen.prompt_token_ids
    assert list(got) == vllm_prompt(tok, card, prompt, keep, side, special)
    assert keep is None or keep < 0 or len(got) <= keep


@settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(text=_TEXT, keep=_KEEP | st.none(), side=_SIDE, special=st.booleans())
def test_a_chat_prompt_is_truncated_as_vllm_truncates_it(
    model: Any, text: str, keep: int | None, side: str | None, special: bool
) -> None:
    """``special``: add_special_tokens (chat: false by default, the template has them)."""
    card, tok = model
    messages = [{"role": "user", "content": text}]
    fields: dict[str, Any] = {"messages": messages, "truncate_prompt_tokens": keep}
    fields |= {"add_special_tokens": special} | ({"truncation_side": side} if side else {})
    body = json.dumps({"model": MODEL, "max_tokens": 16, **fields}).encode()
    got = parse_chat(body, {MODEL: card}).gen.prompt_token_ids
    rendered = card.render_chat(messages)  # the chat's rendering is tested on its own
    assert list(got) == vllm_prompt(tok, card, rendered, keep, side, special)


def test_truncation_keeps_a_long_prompt_in_the_context(model: Any) -> None:
    """A prompt longer than the context is served truncated (refused without truncation);
    a truncation past the context, a negative one or an unknown side is a 400."""
    card, tok = model
    text = " owl" * (card.max_model_len + 10)
    with pytest.raises(HttpError) as refused:
        _completion(card, prompt=text)
    assert refused.value.code == "context_length_exceeded"
    got = _completion(card, prompt=text, truncate_prompt_tokens=-1).gen.prompt_token_ids
    assert len(got) == card.max_model_len - 1
    assert list(got) == vllm_prompt(tok, card, text, -1, None, special=True)
    for fields, param in (
        ({"truncate_prompt_tokens": card.max_model_len + 1}, "truncate_prompt_tokens"),
        ({"truncate_prompt_tokens": -2}, "truncate_prompt_tokens"),
        ({"truncate_prompt_tokens": 3, "truncation_side": "middle"}, "truncation_side"),
    ):
        with pytest.raises(HttpError) as info:
            _completion(card, prompt="owl cat", **fields)
        assert (info.value.status, info.value.param) == (400, param)


def test_the_tokenizer_s_truncation_keeps_its_special_tokens(model: Any) -> None:
    """Fewer tokens kept than the tokenizer adds: its special tokens alone, as vLLM's (the
    example hypothesis found)."""
    card, tok = model
    for keep in (1, 2):
        got = _completion(card, prompt="owl cat", truncate_prompt_tokens=keep)
        assert list(got.gen.prompt_token_ids) == vllm_prompt(tok, card, "owl cat", keep, None, True)
