"""How the chaos suite counts tokens lost and duplicated (no fleet: the tokenizer only)."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.chaos.load import Stream, Tokens, compare, summary

MODEL_DIR = Path(__file__).resolve().parents[2] / "star" / "model" / "tiny"
REF = "the river and the lantern met at dawn, and the falcon sang over the quartz harbor"


@pytest.fixture(scope="module")
def tokens() -> Tokens:
    return Tokens(MODEL_DIR)


def _stream(text: str, outcome: str = "ok") -> Stream:
    s = Stream("p", text=text, done=outcome == "ok")
    if outcome == "error":
        s.error = '{"message": "decode instance lost"}'
    elif outcome == "cut":
        s.cut = "RemoteProtocolError: peer closed connection"
    return s


def test_the_reference_itself_loses_nothing(tokens: Tokens) -> None:
    c = compare(tokens, _stream(REF), REF)
    assert (c.lost, c.duplicated, c.complete) == (0, 0, True)


def test_a_missing_piece_is_lost_and_a_repeated_one_duplicated(tokens: Tokens) -> None:
    ids = tokens.ids(REF)
    n = len(ids)
    assert n > 10
    gap = tokens.text(ids[:5] + ids[8:])  # three tokens never arrived
    c = compare(tokens, _stream(gap), REF)
    assert c.lost >= 1 and not c.complete
    twice = tokens.text(ids[:6] + ids[4:])  # two tokens sent again after a handoff
    c = compare(tokens, _stream(twice), REF)
    assert c.duplicated >= 1 and not c.complete


def test_a_stream_that_ended_with_an_error_is_compared_up_to_its_end(tokens: Tokens) -> None:
    ids = tokens.ids(REF)
    head = tokens.text(ids[:7])
    c = compare(tokens, _stream(head, "error"), REF)
    assert (c.lost, c.duplicated) == (0, 0)  # the client knows its stream ended
    c = compare(tokens, _stream(head + " wrong words", "cut"), REF)
    assert c.duplicated >= 1  # what it got must still be the reference's


def test_summary_counts_outcomes_and_wrong_texts(tokens: Tokens) -> None:
    refs = {"p": REF}
    got = [_stream(REF), _stream(REF + " extra"), _stream("the river", "error"), _stream("", "cut")]
    out = summary(got, refs, tokens)
    assert (out["ok"], out["error"], out["cut"]) == (2, 1, 1)
    assert out["wrong"] == 1 and out["duplicated"] >= 1 and out["lost"] == 0
