"""A conversation with tool calls in it renders as vLLM 0.32 renders it (issue 28).

An agent's second turn sends back the assistant message that called a tool
(``content`` null, ``tool_calls`` with ``arguments`` as a JSON string) and a
``tool`` message. vLLM parses the messages before its chat template sees
them (``_parse_chat_message_content`` and ``_postprocess_messages`` in
``vllm/renderers/chat_utils.py``); the proxy's :func:`as_conversation` must
give the template the same thing, so that a template reading
``message.content`` or ``tool_call.function.arguments`` renders the same
prompt. Before it, the tiny model's template failed on the null content
(``str + None``: a 400), which LangChain's agents hit on their second turn.
"""

from __future__ import annotations

import copy
import json
import warnings
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from proxy.tokenizer import ChatTemplateError, ModelCard, as_conversation
from star.model import tiny_model_path

pytestmark = [
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
]


@pytest.fixture(scope="module")
def model_config() -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from vllm.config import ModelConfig

        return ModelConfig(model=str(tiny_model_path()))


def vllm_conversation(messages: list[dict[str, Any]], model_config: Any) -> list[dict[str, Any]]:
    """vLLM's own parse of the messages for a string-content template (the tiny model's)."""
    from vllm.renderers.chat_utils import parse_chat_messages

    conversation, _, _ = parse_chat_messages(copy.deepcopy(messages), model_config, "string")  # type: ignore[arg-type]
    return [dict(m) for m in conversation]


def call(arguments: Any, name: str = "get_weather") -> dict[str, Any]:
    return {"id": "call-1", "type": "function", "function": {"name": name, "arguments": arguments}}


AGENT_TURN = [
    {"role": "user", "content": "what is the weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [call('{"city": "Paris"}')]},
    {"role": "tool", "tool_call_id": "call-1", "content": "sunny, 21 C"},
]


def test_an_agents_second_turn_renders() -> None:
    card = ModelCard.load(tiny_model_path(), "tiny")
    text = card.render_chat(AGENT_TURN)
    assert "<|im_start|>assistant\n<|im_end|>" in text  # the call's message, without text
    assert "<|im_start|>tool\nsunny, 21 C<|im_end|>" in text
    got = as_conversation(AGENT_TURN)
    assert got[1]["content"] == ""
    assert got[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    assert AGENT_TURN[1]["content"] is None  # the request's messages are left as they are


def _fields(m: dict[str, Any]) -> dict[str, Any]:
    # vLLM keeps what a template reads of a message: role, content, tool_calls, tool_call_id.
    keep = ("role", "content", "tool_calls", "tool_call_id")
    return {k: m[k] for k in keep if k in m}


arguments = st.one_of(
    st.none(),
    st.just(""),
    st.just("not json"),
    st.just("[1, 2]"),
    st.just("42"),
    st.dictionaries(st.text(max_size=5), st.integers(), max_size=3).map(json.dumps),
    st.dictionaries(st.text(max_size=5), st.integers(), max_size=3),
)
message = st.one_of(
    st.fixed_dictionaries(
        {"role": st.sampled_from(["user", "system"]), "content": st.text(max_size=20)}
    ),
    st.fixed_dictionaries(
        {
            "role": st.just("assistant"),
            "content": st.one_of(st.none(), st.text(max_size=20)),
            "tool_calls": st.lists(arguments.map(call), max_size=3),
        }
    ),
    st.fixed_dictionaries(
        {"role": st.just("tool"), "tool_call_id": st.just("call-1"), "content": st.text(max_size=9)}
    ),
)


@given(messages=st.lists(message, min_size=1, max_size=5))
def test_the_conversation_is_vllms(messages: list[dict[str, Any]], model_config: Any) -> None:
    want = [_fields(m) for m in vllm_conversation(messages, model_config)]
    assert [_fields(m) for m in as_conversation(messages)] == want


@pytest.mark.parametrize(
    ("calls", "says"),
    [(["a string"], "must be objects"), ([{"type": "custom", "custom": {}}], "type 'function'")],
)
def test_malformed_calls_are_refused_as_vllm_refuses_them(calls: list[Any], says: str) -> None:
    with pytest.raises(ChatTemplateError, match=says):
        as_conversation([{"role": "assistant", "content": "", "tool_calls": calls}])
