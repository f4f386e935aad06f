"""``star bench conformance``'s comparison: streams put together, fields compared (no servers)."""

from __future__ import annotations

from typing import Any

from benchmarks.conformance import Case, assembled, cases, differences, markdown, whole


def test_a_stream_is_put_together_as_the_whole_response() -> None:
    full: dict[str, Any] = {
        "object": "text_completion",
        "choices": [
            {
                "index": 0,
                "text": "ab",
                "finish_reason": "length",
                "stop_reason": None,
                "logprobs": {
                    "text_offset": [0, 1],
                    "token_logprobs": [-0.5, -1.0],
                    "tokens": ["a", "b"],
                    "top_logprobs": [{"a": -0.5}, {"b": -1.0}],
                },
            }
        ],
        "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5},
    }
    chunks: list[dict[str, Any]] = [
        {
            "object": "text_completion",
            "choices": [
                {
                    "index": 0,
                    "text": "a",
                    "finish_reason": None,
                    "logprobs": {
                        "text_offset": [0],
                        "token_logprobs": [-0.5],
                        "tokens": ["a"],
                        "top_logprobs": [{"a": -0.5}],
                    },
                }
            ],
        },
        {
            "object": "text_completion",
            "choices": [
                {
                    "index": 0,
                    "text": "b",
                    "finish_reason": "length",
                    "logprobs": {
                        "text_offset": [1],
                        "token_logprobs": [-1.0],
                        "tokens": ["b"],
                        "top_logprobs": [{"b": -1.0}],
                    },
                }
            ],
        },
        {"object": "text_completion", "choices": [], "usage": full["usage"]},
    ]
    assert differences(whole("completions", full), assembled("completions", chunks), 0.0) == []


def test_chat_tool_call_deltas_are_joined() -> None:
    chunks = [
        {
            "object": "chat.completion.chunk",
            "choices": [{"index": 0, "delta": {"role": "assistant"}}],
        },
        {
            "object": "chat.completion.chunk",
            "choices": [
                {
                    "index": 0,
                    "delta": {
                        "tool_calls": [
                            {
                                "index": 0,
                                "id": "x",
                                "type": "function",
                                "function": {"name": "f", "arguments": ""},
                            }
                        ]
                    },
                }
            ],
        },
        {
            "object": "chat.completion.chunk",
            "choices": [
                {
                    "index": 0,
                    "delta": {"tool_calls": [{"index": 0, "function": {"arguments": '{"a": 1}'}}]},
                    "finish_reason": "tool_calls",
                }
            ],
        },
    ]
    doc = assembled("chat", chunks)
    assert doc["choices"]["0"]["tool_calls"] == [
        {"type": "function", "name": "f", "arguments": '{"a": 1}'}
    ]
    assert doc["choices"]["0"]["finish_reason"] == "tool_calls"


def test_differences_name_each_field_and_hold_floats_to_the_tolerance() -> None:
    a = {"choices": {"0": {"text": "ab", "logprobs": [-0.5, -1.0]}}, "usage": {"total_tokens": 5}}
    close = {
        "choices": {"0": {"text": "ab", "logprobs": [-0.50005, -1.0]}},
        "usage": {"total_tokens": 5},
    }
    assert differences(a, close, 1e-4) == []
    assert differences(a, close, 1e-6) == [".choices.0.logprobs[0] (-0.5 vs -0.50005)"]
    other = {"choices": {"0": {"text": "ac", "logprobs": [-0.5]}}, "usage": {"total_tokens": 6}}
    assert differences(a, other, 1e-4) == [
        ".choices.0.logprobs (length 2 vs 1)",
        ".choices.0.text ('ab' vs 'ac')",
        ".usage.total_tokens (5 vs 6)",
    ]
    # Error rows: status and type compared, the wording is not.
    e1 = {"status": 400, "error_type": "BadRequestError", "message": "one wording"}
    e2 = {"status": 400, "error_type": "BadRequestError", "message": "another"}
    assert differences(e1, e2, 0.0) == []
    assert differences(e1, {**e2, "status": 422}, 0.0) == [".status (400 vs 422)"]


def test_the_table_names_each_row_once_and_counts_its_sequences() -> None:
    table = cases()
    labels = [f"{c.route}: {c.name}" for c in table]
    assert len(labels) == len(set(labels))
    more = [f"{c.route}: {c.name}" for c in cases(reasoning=True)]
    assert len(more) == len(set(more)) and set(more) > set(labels)
    fan = next(c for c in table if c.name == "batched prompts, n=2")
    assert fan.sequences() == 4
    assert Case("x", "completions", {"prompt": [1, 2, 3]}).sequences() == 1
    body = Case("x", "chat", {"max_tokens": None, "max_completion_tokens": 5}).request("m", True)
    assert "max_tokens" not in body and body["stream_options"] == {"include_usage": True}


def test_markdown_puts_a_parameters_two_rows_on_one_line() -> None:
    def row(stream: bool, identical: bool, migrated: str) -> dict[str, object]:
        return {
            "route": "chat",
            "parameter": "stop",
            "stream": stream,
            "vllm": "served",
            "star": "served",
            "identical": identical,
            "migrated": migrated,
            "migrated_differences": [] if identical else ["x"],
        }

    text = markdown([row(False, True, "resumed"), row(True, False, "refused: a|b")])
    assert text.splitlines()[2] == (
        "| chat | `stop` | served | served | yes; **no** | resumed; refused: a\\|b | yes; **no** |"
    )
