"""Incremental detokenisation and stop strings: invariants, checked with hypothesis."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

from proxy.detok import IncrementalDetokenizer, StopMatcher, TextStream
from tests.proxy.fakes import SPECIALS, build_tokenizer

TOK = build_tokenizer()
VOCAB = TOK.get_vocab_size()
SPECIAL_IDS = [TOK.token_to_id(s) for s in SPECIALS]
TEXT_ALPHABET = st.sampled_from([*"ab c.\n", "é", "你", "好", "😀", "ß", "€", "\u200d"])

# Random ids hit lone UTF-8 continuation bytes and half characters constantly.
token_ids = st.lists(st.integers(0, VOCAB - 1), max_size=60)
splits = st.lists(st.integers(1, 5), min_size=1, max_size=60)


def chunked(ids: list[int], sizes: list[int]) -> list[list[int]]:
    out, pos, i = [], 0, 0
    while pos < len(ids):
        n = sizes[i % len(sizes)]
        out.append(ids[pos : pos + n])
        pos, i = pos + n, i + 1
    return out


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ids=token_ids, sizes=splits, skip=st.booleans())
def test_streamed_text_equals_decode_of_all_tokens(
    ids: list[int], sizes: list[int], skip: bool
) -> None:
    detok = IncrementalDetokenizer(TOK, skip_special_tokens=skip)
    parts = [detok.step(batch) for batch in chunked(ids, sizes)]
    parts.append(detok.flush())
    assert "".join(parts) == TOK.decode(ids, skip_special_tokens=skip)
    # No chunk ends in the middle of a character it could still complete.
    for part in parts[:-1]:
        assert not part.endswith("\ufffd") or TOK.decode(ids, skip_special_tokens=skip).count(
            "\ufffd"
        )


@settings(max_examples=200, deadline=None)
@given(text=st.text(TEXT_ALPHABET, max_size=40), prompt=st.text(TEXT_ALPHABET, max_size=20))
def test_real_text_streams_whole_characters_after_a_prompt(text: str, prompt: str) -> None:
    ids = TOK.encode(text).ids
    detok = IncrementalDetokenizer(TOK, prompt_token_ids=TOK.encode(prompt).ids)
    parts = [detok.step([i]) for i in ids]
    assert detok.flush() == ""
    assert "".join(parts) == text
    assert all("\ufffd" not in p for p in parts)


@settings(max_examples=200, deadline=None)
@given(prompt=token_ids, ids=token_ids, sizes=splits)
def test_a_prompt_never_leaks_into_the_output(
    prompt: list[int], ids: list[int], sizes: list[int]
) -> None:
    detok = IncrementalDetokenizer(TOK, prompt_token_ids=prompt)
    out = "".join(detok.step(b) for b in chunked(ids, sizes)) + detok.flush()
    # Byte-level BPE: the primed (clean) prompt suffix ends on a character
    # boundary, so the output is exactly the generated ids' own text.
    assert out == TOK.decode(ids)


def test_multibyte_character_is_never_split() -> None:
    ids = TOK.encode("😀").ids
    byte_ids = [TOK.token_to_id(TOK.id_to_token(i)) for i in ids]
    assert byte_ids == ids
    # Emoji is four bytes; feed the byte tokens of one that BPE did not merge.
    raw = [TOK.token_to_id(c) for c in "ðŁĺĢ"]  # byte-level symbols of U+1F600
    assert None not in raw
    detok = IncrementalDetokenizer(TOK)
    out = [detok.step([i]) for i in raw]
    assert out == ["", "", "", "😀"]


def test_special_tokens_are_skipped_by_default() -> None:
    ids = [*TOK.encode("hello").ids, SPECIAL_IDS[2]]
    assert IncrementalDetokenizer(TOK).step(ids) == "hello"
    assert IncrementalDetokenizer(TOK, skip_special_tokens=False).step(ids) == "hello<|im_end|>"


def test_invalid_token_id_does_not_break_the_stream() -> None:
    detok = IncrementalDetokenizer(TOK)
    detok.step([VOCAB + 1000])
    assert detok.step(TOK.encode("ok").ids) + detok.flush() in ("ok",)


# -- stop strings ------------------------------------------------------------------


def reference_cut(text: str, stops: list[str], include: bool) -> tuple[str, str | None]:
    # Streaming semantics: the first stop string to be complete wins.
    hits = [(text.find(s) + len(s), text.find(s), s) for s in stops if s and s in text]
    if not hits:
        return text, None
    _, at, stop = min(hits)
    return (text[: at + len(stop)] if include else text[:at]), stop


stop_lists = st.lists(
    st.text(st.sampled_from("abc"), min_size=1, max_size=4), min_size=1, max_size=3
)


@settings(max_examples=500, deadline=None)
@given(
    text=st.text(st.sampled_from("abcd"), max_size=40),
    stops=stop_lists,
    cuts=st.lists(st.integers(0, 40), max_size=10),
    include=st.booleans(),
)
def test_stop_matcher_cuts_like_a_search_over_the_whole_text(
    text: str, stops: list[str], cuts: list[int], include: bool
) -> None:
    pieces, prev = [], 0
    for c in sorted(set(cuts)):
        pieces.append(text[prev:c])
        prev = max(prev, c)
    pieces.append(text[prev:])
    m = StopMatcher(stops, include)
    released, matched = [], None
    for piece in pieces:
        out, matched = m.feed(piece)
        released.append(out)
        # Whatever was released can never turn out to be part of a stop string.
        if matched is None:
            assert not any(s in "".join(released) for s in stops)
        else:
            break
    if matched is None:
        released.append(m.flush())
    assert ("".join(released), matched) == reference_cut(text, stops, include)


@settings(max_examples=200, deadline=None)
@given(text=st.text(TEXT_ALPHABET, min_size=1, max_size=30), data=st.data())
def test_text_stream_stops_on_a_stop_string_and_counts_tokens(
    text: str, data: st.DataObject
) -> None:
    start = data.draw(st.integers(0, len(text) - 1))
    stop = text[start : start + data.draw(st.integers(1, 3))]
    ids = TOK.encode(text).ids
    stream = TextStream(TOK, stop=[stop])
    out = ""
    for i in ids:
        out += stream.feed([i])
        if stream.finished:
            break
    if not stream.finished:
        out += stream.finish("length")
    assert stream.finish_reason == "stop" and stream.stop_reason == stop
    assert out == text[: text.find(stop)]
    # The count stops at the token whose (released) text completed the match.
    assert stop in TOK.decode(ids[: stream.num_tokens])
    before = IncrementalDetokenizer(TOK)
    assert stop not in "".join(before.step([i]) for i in ids[: stream.num_tokens - 1])


def test_text_stream_releases_held_back_text_at_the_end() -> None:
    stream = TextStream(TOK, stop=["STOP here"])
    ids = TOK.encode("not ST").ids
    out = stream.feed(ids)
    assert out == "not "  # "ST" might begin "STOP here"
    assert stream.finish("length") == "ST"
    assert (stream.finish_reason, stream.stop_reason, stream.num_tokens) == (
        "length",
        None,
        len(ids),
    )


def test_stop_string_is_ignored_before_min_tokens() -> None:
    ids = TOK.encode("a.a.a.").ids
    stream = TextStream(TOK, stop=["."], min_tokens=3)
    out = "".join(stream.feed([i]) for i in ids)
    assert stream.finish_reason == "stop"
    assert out == TOK.decode(ids[:3]) + TOK.decode(ids[3:]).split(".")[0]


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_include_in_output(include: bool) -> None:
    stream = TextStream(TOK, stop=["42"], include_stop_str_in_output=include)
    out = stream.feed(TOK.encode("The answer is 42. Done").ids)
    assert out == ("The answer is 42" if include else "The answer is ")


def _wordpiece() -> Tokenizer:
    """A tokenizer whose decoder puts a space before every token, special ones too
    (BERT's WordPiece): where ``spaces_between_special_tokens`` shows."""
    vocab = {"[UNK]": 0, "hello": 1, "world": 2, "##s": 3, "owl": 4}
    tok = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.WordPiece()
    tok.add_special_tokens([AddedToken(t, special=True) for t in ("[CLS]", "[SEP]", "[X]")])
    return tok


def _vllm_text(tok: Tokenizer, prompt: list[int], ids: list[int], spaces: bool) -> str:
    """vLLM 0.32's FastIncrementalDetokenizer, special tokens shown, one token a step."""
    from types import SimpleNamespace

    from vllm import SamplingParams
    from vllm.v1.engine.detokenizer import FastIncrementalDetokenizer

    params = SamplingParams(skip_special_tokens=False, spaces_between_special_tokens=spaces)
    request = SimpleNamespace(sampling_params=params, prompt_token_ids=prompt, request_id="x")
    detok = FastIncrementalDetokenizer(SimpleNamespace(_tokenizer=tok), request)  # type: ignore[arg-type]
    out = ""
    for tid in ids:
        detok.update([tid], False)
        out += detok.get_next_output_text(False, True)
    return out + detok.get_next_output_text(True, True)


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@pytest.mark.filterwarnings("ignore::FutureWarning")
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    ids=st.lists(st.integers(1, 7), min_size=1, max_size=16),
    cuts=st.lists(st.integers(1, 16), max_size=6),
    spaces=st.booleans(),
)
def test_spaces_between_special_tokens_as_vllms_detokenizer(
    ids: list[int], cuts: list[int], spaces: bool
) -> None:
    """``spaces_between_special_tokens: false`` (issue 28): an added token right after
    another is its raw content; the same text as vLLM's, however the ids are batched."""
    tok = _wordpiece()
    stream = TextStream(tok, [1], skip_special_tokens=False, spaces_between_special_tokens=spaces)
    bounds = sorted({c % (len(ids) + 1) for c in cuts} | {0, len(ids)})
    text = "".join(stream.feed(ids[a:b]) for a, b in itertools.pairwise(bounds))
    text += stream.finish("length")
    assert text == _vllm_text(tok, [1], ids, spaces)
