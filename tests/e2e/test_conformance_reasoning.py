"""Reasoning and structured outputs answer as vLLM's own server does, migrated too (issue 28).

``star bench conformance --reasoning-parser deepseek_r1 --migrate``, as a
user runs it, on the rows where the reasoning decides where a grammar starts
(``benchmarks.conformance.reasoning_cases``) and on two plain chat rows:
a plain vLLM server and a STAR fleet, both with vLLM's ``deepseek_r1``
reasoning parser, serve the shipped tiny model with the reasoning markup
added (``star.model.markup``). Each answer (reasoning, content, finish
reason, usage with its reasoning tokens) must equal vLLM's, field by field,
also when each request was moved to the other decode instance mid-answer
(the target's grammar replayed past the reasoning's end).
"""

from __future__ import annotations

import json

import pytest

from benchmarks import conformance

pytestmark = [
    pytest.mark.engine,
    pytest.mark.timeout(1500),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
]

ONLY = ["chat: reasoning:", "chat: greedy", "chat: structured outputs: choice"]


def test_reasoning_rows_answer_as_vllms_own_server_migrated_too(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ["--reasoning-parser", "deepseek_r1", "--migrate", "--json"]
    for only in ONLY:
        argv += ["--only", only]
    code = conformance.main(argv)
    rows = json.loads(capsys.readouterr().out)
    by = {(r["parameter"], r["stream"]): r for r in rows}
    assert len(rows) == 2 * 6, sorted(by)
    differing = {
        k: r["differences"] + r["migrated_differences"]
        for k, r in by.items()
        if not r["identical"] or r["migrated_differences"]
    }
    assert differing == {}
    assert code == 0
    assert all(r["vllm"] == "served" for r in rows)

    def message(parameter: str) -> dict[str, object]:
        return by[(parameter, False)]["vllm_response"]["choices"]["0"]  # type: ignore[no-any-return]

    # What the rows show. The tiny model writes no </think>: with a grammar waiting for
    # it the answer is free text to max_tokens, all reasoning to vLLM's parser.
    waiting = by[("structured outputs: choice", False)]["vllm_response"]
    assert waiting["usage"]["completion_tokens"] == conformance.MAX_TOKENS
    assert waiting["choices"]["0"]["content"] is None and waiting["choices"]["0"]["reasoning"]
    # Where the reasoning ended (include_reasoning false, or in the prompt) the grammar
    # binds from the first token: a choice, then EOS (vLLM's R1 parser still calls the
    # text reasoning, and include_reasoning false hides it).
    for parameter in (
        "reasoning: choice, include_reasoning false",
        "reasoning: choice, the prompt ends the reasoning",
    ):
        doc = by[(parameter, False)]["vllm_response"]
        assert doc["choices"]["0"]["finish_reason"] == "stop"
        assert doc["usage"]["completion_tokens"] < conformance.MAX_TOKENS
    ended = message("reasoning: choice, the prompt ends the reasoning")
    assert ended["reasoning"] in {"owl", "cat", "fox"}
    # </think> forced mid-answer: the grammar from the next token, the rest content.
    forced = message("reasoning: regex after a forced </think>")
    assert forced["reasoning"] is None
    assert str(forced["content"]).split(" ")[0] in {"owl", "cat"}
    # Every request was moved mid-answer (a burst of 0 ms lands before its first step).
    assert all("resumed" in str(r["migrated"]) for r in rows), [r["migrated"] for r in rows]
