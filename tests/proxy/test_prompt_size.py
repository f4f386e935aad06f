"""A prompt too long in bytes for the context is refused before it is tokenised
(issue 27 item 4): the bound a tokenizer allows, where it allows one, and the
400 it gives."""

from __future__ import annotations

import dataclasses
import json
import unicodedata
from typing import Any, Literal

import pytest
from tokenizers import AddedToken, Tokenizer, models, normalizers, pre_tokenizers

from proxy import tokenizer
from proxy.http import HttpError
from proxy.openai import parse_chat, parse_completion
from proxy.tokenizer import ModelCard, bytes_per_token
from tests.proxy.test_app import TINY


class _CountingTokenizer:
    """The real tokenizer, counting encode calls (a Rust object cannot be patched)."""

    def __init__(self, tok: Tokenizer) -> None:
        self.tok = tok
        self.encoded = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.tok, name)

    def encode(self, *args: Any, **kwargs: Any) -> Any:
        self.encoded += 1
        return self.tok.encode(*args, **kwargs)


def _counting_card(card: ModelCard) -> tuple[ModelCard, _CountingTokenizer]:
    spy = _CountingTokenizer(card.tokenizer)
    return dataclasses.replace(card, tokenizer=spy), spy  # type: ignore[arg-type]


def test_the_test_tokenizers_have_a_bound(card: ModelCard) -> None:
    assert card.max_bytes_per_token == 16  # byte-level BPE, longest token 16 bytes
    assert card.max_model_len * 16 == 8192


@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_a_prompt_too_long_in_bytes_is_refused_before_tokenising(
    card: ModelCard, kind: str
) -> None:
    counted, spy = _counting_card(card)
    limit = card.max_model_len * 16
    text = "ab" * (limit // 2 + 1)  # one byte more than the limit can hold
    if kind == "completion":
        body: dict[str, Any] = {"model": "tiny", "prompt": text}
        parse, param, size = parse_completion, "prompt", len(text)
    else:
        messages = [{"role": "user", "content": text}]
        body = {"model": "tiny", "messages": messages}
        parse, param = parse_chat, "messages"
        size = len(card.render_chat(messages).encode())  # the template's text counts
    with pytest.raises(HttpError) as info:
        parse(json.dumps(body).encode(), {"tiny": counted})
    assert spy.encoded == 0
    err = info.value
    assert (err.status, err.type, err.param, err.code) == (
        400,
        "BadRequestError",
        param,
        "context_length_exceeded",
    )
    assert err.message.startswith(f"This model's maximum context length is {card.max_model_len}")
    assert f"at least {-(-size // 16)} tokens in the {param} ({size} bytes" in err.message


def test_a_prompt_within_the_byte_limit_is_tokenised(card: ModelCard) -> None:
    counted, spy = _counting_card(card)
    text = "x" * (card.max_model_len * 16)  # at the limit: 8192 bytes may still fit
    with pytest.raises(HttpError) as info:  # it does not (one token per ~8 x)
        parse_completion(json.dumps({"model": "tiny", "prompt": text}).encode(), {"tiny": counted})
    assert spy.encoded == 1 and "at least" not in info.value.message
    ok = parse_completion(
        json.dumps({"model": "tiny", "prompt": "x" * 100}).encode(), {"tiny": counted}
    )
    assert ok.gen.prompt_token_ids == card.encode("x" * 100)


def _worst_cases(tok: Tokenizer) -> list[str]:
    vocab = tok.get_vocab()
    alphabet = set(pre_tokenizers.ByteLevel.alphabet())
    longest = max((t for t in vocab if set(t) <= alphabet), key=len)
    table = {ch: b for b, ch in zip(range(256), _byte_chars(), strict=True)}
    raw = bytes(table[ch] for ch in longest).decode("utf-8", "replace")
    return [
        raw * 500,  # the longest token, over and over
        "\u212a" * 500,  # KELVIN SIGN: NFC makes it "K", 3 bytes -> 1
        "\u1100\u1161\u11a8" * 300,  # three jamo compose into one syllable under NFC
        "你好世界😀" * 300,
        "<|im_start|><|im_end|>" * 200,  # added tokens
        " " * 4000,
    ]


def _byte_chars() -> list[str]:
    # GPT-2's bytes_to_unicode, in byte order.
    keep = [*range(33, 127), *range(161, 173), *range(174, 256)]
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


def test_no_text_has_fewer_tokens_than_its_bytes_allow(card: ModelCard) -> None:
    """The bound holds on the texts that come closest to it, for both test tokenizers."""
    cards = [card]
    if (TINY / "tokenizer.json").is_file():
        cards.append(ModelCard.load(TINY))
    for c in cards:
        per_token = c.max_bytes_per_token
        assert per_token is not None
        for text in _worst_cases(c.tokenizer):
            tokens = len(c.tokenizer.encode(text, add_special_tokens=False).ids)
            assert tokens * per_token >= len(text.encode()), (c.name, text[:20])


Form = Literal["NFC", "NFD", "NFKC", "NFKD"]
_FORMS: list[tuple[Form, Form]] = [
    ("NFC", "NFD"),
    ("NFD", "NFD"),
    ("NFKC", "NFKD"),
    ("NFKD", "NFKD"),
]


def test_the_normalizer_factors_hold_for_every_code_point() -> None:
    """tokenizer._SHRINK: no character shrinks more, nor composes from more."""
    chars = [chr(c) for c in range(0x110000) if not 0xD800 <= c <= 0xDFFF]
    for form, decomposing in _FORMS:
        worst = max(
            len(c.encode()) / len(unicodedata.normalize(form, c).encode())
            for c in chars
            if not unicodedata.is_normalized(form, c)
        )
        if form != decomposing:  # composition: a character from its decomposition
            parts = (
                (c, unicodedata.normalize(decomposing, c))
                for c in chars
                if not unicodedata.is_normalized(decomposing, c)
            )
            worst = max(
                worst,
                *(
                    len(d.encode()) / len(c.encode())
                    for c, d in parts
                    if unicodedata.normalize(form, d) == c
                ),
            )
        assert worst <= tokenizer._SHRINK[form], form
    assert max(len(c.encode()) / max(len(c.lower().encode()), 1) for c in chars) <= 3


def _bpe(**kwargs: Any) -> Tokenizer:
    vocab = {"a": 0, "b": 1, "ab": 2, "<u>": 3}
    return Tokenizer(models.BPE(vocab, [("a", "b")], **kwargs))


def test_pipelines_that_can_drop_text_get_no_bound() -> None:
    assert bytes_per_token(_bpe(unk_token="<u>")) == 4  # one unknown character per token
    fused = _bpe(unk_token="<u>", fuse_unk=True)
    assert bytes_per_token(fused) is None  # a run of unknown characters is one token
    assert bytes_per_token(_bpe()) is None  # unknown characters vanish
    for normalizer in (
        normalizers.Strip(),
        normalizers.StripAccents(),
        normalizers.BertNormalizer(),
    ):
        tok = _bpe(unk_token="<u>")
        tok.normalizer = normalizer
        assert bytes_per_token(tok) is None, normalizer
    tok = _bpe(unk_token="<u>")
    tok.normalizer = normalizers.Sequence([normalizers.NFKC(), normalizers.Lowercase()])
    assert bytes_per_token(tok) == 4 * 4 * 3
    for pre in (pre_tokenizers.Whitespace(), pre_tokenizers.BertPreTokenizer()):
        tok = _bpe(unk_token="<u>")
        tok.pre_tokenizer = pre
        assert bytes_per_token(tok) is None, pre
    tok = _bpe(unk_token="<u>")
    tok.pre_tokenizer = pre_tokenizers.Split(" ", behavior="removed")
    assert bytes_per_token(tok) is None
    tok = _bpe(unk_token="<u>")
    tok.add_special_tokens([AddedToken("<s>", rstrip=True)])
    assert bytes_per_token(tok) is None  # it swallows the spaces after it
    assert bytes_per_token(Tokenizer(models.WordPiece({"a": 0, "[UNK]": 1}))) is None
