"""Tool calls and reasoning in chat completions, as vLLM's OpenAI server gives them.

The work is done by vLLM's own classes, imported in the proxy: the parser
:class:`vllm.parser.ParserManager` composes from a reasoning parser (named as
vLLM's ``--reasoning-parser``, setting ``proxy.reasoning_parser``) and a
tool-call parser (``--tool-call-parser`` with ``--enable-auto-tool-choice``,
settings ``proxy.tool_call_parser`` and ``proxy.enable_auto_tool_choice``),
and vLLM's ``ChatCompletionRequest`` to validate ``tools`` / ``tool_choice``.
What this module reproduces is the serving code around them (vLLM 0.32,
``entrypoints/openai/chat_completion/serving.py`` and
``renderers/online_renderer.py``):

* the request: ``tool_choice`` checked against the configured parsers (the
  same 400s), the tools given to the chat template (``tools=``), and the
  parser's ``adjust_request``, which turns a ``required`` or named tool
  choice into structured outputs (a JSON schema or a structural tag built
  from the tools' parameters) that the engine decodes under;
* the response: each choice's text split by the parser into ``reasoning``,
  ``content`` and ``tool_calls`` (:meth:`ChoiceParser.message`), or per
  streamed delta (:meth:`ChoiceParser.delta`), with vLLM's ``finish_reason``
  rule (``tool_calls`` for auto and required calls).

vLLM is imported only when a model has a parser configured or a request
carries tools: :func:`check` refuses, at start, a setting the installed vLLM
cannot serve.
"""

from __future__ import annotations

import dataclasses
import threading
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from proxy.http import HttpError

if TYPE_CHECKING:
    from proxy.tokenizer import ModelCard

# The request fields vLLM's parsers and the choice logic read (a subset of the body).
_FIELDS = ("tools", "tool_choice", "parallel_tool_calls", "include_reasoning")
_lock = threading.Lock()
_tokenizers: dict[str, Any] = {}
_parsers: dict[tuple[str, str, str, bool], Any] = {}


def _import_vllm() -> None:
    """Import what this module uses of vLLM once, its import-time deprecation warnings muted."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        warnings.simplefilter("ignore", FutureWarning)
        import vllm.entrypoints.generate.base.protocol
        import vllm.entrypoints.openai.chat_completion.protocol
        import vllm.parser
        import vllm.renderers.chat_utils
        import vllm.tokenizers  # noqa: F401


class ParserConfigError(ValueError):
    """A parser setting the installed vLLM cannot serve (refused at start)."""


@dataclass(frozen=True, slots=True)
class ChatCall:
    """What a chat request asked of tools and reasoning (picklable: parse workers send it)."""

    # The fields of the body vLLM's request model is rebuilt from (tools etc.).
    request: Mapping[str, Any]
    prompt_token_ids: tuple[int, ...] = ()
    # The chat template's kwargs as vLLM's server gives them to its parser
    # (ChatCompletionRequest.build_chat_params): the request's own and
    # add_generation_prompt / continue_final_message.
    template_kwargs: Mapping[str, Any] = field(default_factory=dict)


def configured(card: ModelCard) -> bool:
    """Whether ``card`` has a reasoning or tool-call parser (vLLM builds a parser then)."""
    return bool(card.reasoning_parser) or (
        bool(card.tool_call_parser) and card.enable_auto_tool_choice
    )


def check(card: ModelCard) -> None:
    """Build the model's parser once (at start): ParserConfigError if it cannot be."""
    if card.enable_auto_tool_choice and not card.tool_call_parser:
        raise ParserConfigError(
            "proxy.enable_auto_tool_choice needs proxy.tool_call_parser (as vLLM's "
            "--enable-auto-tool-choice needs --tool-call-parser)"
        )
    if configured(card):
        parser_class(card)


def _tokenizer_dir(card: ModelCard) -> str:
    if card.tokenizer_file is None:
        raise ParserConfigError(
            f"model {card.name!r}: a reasoning or tool-call parser needs the model loaded "
            "from a directory (vLLM's parsers read its tokenizer)"
        )
    return str(Path(card.tokenizer_file).parent)


def vllm_tokenizer(card: ModelCard) -> Any:
    """vLLM's tokenizer of ``card``'s model directory (what its parsers are given)."""
    where = _tokenizer_dir(card)
    with _lock:
        tok = _tokenizers.get(where)
        if tok is None:
            _import_vllm()
            from vllm.tokenizers import get_tokenizer

            tok = _tokenizers[where] = get_tokenizer(where)
        return tok


def parser_class(card: ModelCard) -> Any:
    """vLLM's composed parser class for ``card`` (None without parsers), built once."""
    if not configured(card):
        return None
    key = (
        _tokenizer_dir(card),
        card.reasoning_parser,
        card.tool_call_parser,
        card.enable_auto_tool_choice,
    )
    with _lock:
        if key in _parsers:
            return _parsers[key]
    try:
        _import_vllm()
        from vllm.parser import ParserManager
    except ImportError as exc:
        raise ParserConfigError(
            "proxy.reasoning_parser / proxy.tool_call_parser use vLLM's parsers, and vllm "
            f"cannot be imported on this host: {exc}"
        ) from exc
    try:
        cls = ParserManager.get_parser(
            tool_parser_name=card.tool_call_parser or None,
            reasoning_parser_name=card.reasoning_parser or None,
            enable_auto_tools=card.enable_auto_tool_choice,
            model_name=card.name,
            tokenizer=vllm_tokenizer(card),
        )
    except (TypeError, ValueError, KeyError) as exc:
        raise ParserConfigError(f"model {card.name!r}: {exc}") from exc
    with _lock:
        _parsers[key] = cls
    return cls


def _parses_plain_chats(card: ModelCard) -> bool:
    """Whether a chat without tools can come out of vLLM's parser other than as plain text.

    Only with a reasoning parser or an engine-based tool parser: a legacy
    tool parser passes the text of a request without tools (tool_choice
    none) through as content, so such a chat is served as one without
    parsers (and stays resumable).
    """
    cls = parser_class(card)
    if cls is None:
        return False
    tool_parser = cls.tool_parser_cls
    engine_based = tool_parser is not None and tool_parser.engine_based_streaming
    return cls.reasoning_parser_cls is not None or bool(engine_based)


def _vllm_request(card: ModelCard, fields: Mapping[str, Any]) -> Any:
    _import_vllm()
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

    body = {"model": card.name, "messages": [{"role": "user", "content": ""}], **fields}
    return ChatCompletionRequest.model_validate(body)


def _bad_request(exc: Exception, param: str) -> HttpError:
    message = str(exc)
    errors = getattr(exc, "errors", None)
    if callable(errors):  # pydantic: the first error's message, as vLLM's 400 says it
        try:
            first = errors()[0]
            message = str(first.get("msg", message))
        except (IndexError, TypeError, AttributeError):
            pass
    param = getattr(exc, "parameter", None) or param
    return HttpError(400, message, param=param, code="invalid_value")


@dataclass(frozen=True, slots=True)
class Prepared:
    """:func:`prepare`'s answer: the call, the template's tools, the structured outputs."""

    call: ChatCall
    tools: list[dict[str, Any]] | None
    structured_outputs: dict[str, Any] | None


def prepare(body: Mapping[str, Any], card: ModelCard) -> Prepared | None:
    """Check ``tools`` / ``tool_choice`` as vLLM does; None when neither is asked nor configured."""
    fields = {k: body[k] for k in _FIELDS if body.get(k) is not None}
    if "tools" not in fields and "tool_choice" not in fields and not _parses_plain_chats(card):
        return None
    try:
        from vllm.exceptions import VLLMValidationError

        request = _vllm_request(card, fields)
    except ImportError as exc:
        raise HttpError(
            400,
            f"'tools' need vLLM's request model on the proxy host: {exc}",
            param="tools",
            code="unsupported_parameter",
        ) from None
    except (ValueError, VLLMValidationError) as exc:  # pydantic's ValidationError, vLLM's
        raise _bad_request(exc, "tools" if "tools" in fields else "tool_choice") from None
    cls = parser_class(card)
    tool_parser = cls.tool_parser_cls if cls is not None else None
    choice = request.tool_choice
    if tool_parser is None and choice not in (None, "none"):
        if choice == "auto":
            message = (
                '"auto" tool choice requires proxy.enable_auto_tool_choice and '
                "proxy.tool_call_parser to be set (vLLM's --enable-auto-tool-choice and "
                "--tool-call-parser)"
            )
        else:
            named = getattr(getattr(choice, "function", None), "name", None)
            desc = f'function "{named}"' if named else f'"{choice}"'
            message = (
                f"tool_choice={desc} requires proxy.tool_call_parser and "
                "proxy.enable_auto_tool_choice to be set (vLLM's --tool-call-parser)"
            )
        raise HttpError(400, message, param="tool_choice", code="invalid_value")
    tools = [t.model_dump() for t in request.tools] if request.tools else None
    structured = None
    if cls is not None and (cls.reasoning_parser_cls is not None or choice != "none"):
        # vLLM's preprocess_chat: the parser's adjust_request (forced tool choices).
        try:
            adjusted = cls(vllm_tokenizer(card), request.tools).adjust_request(request)
        except (ValueError, VLLMValidationError) as exc:
            raise _bad_request(exc, "tools") from None
        given = adjusted.structured_outputs
        if given is not None:
            structured = {
                f.name: getattr(given, f.name)
                for f in dataclasses.fields(given)
                if not f.name.startswith("_") and getattr(given, f.name) not in (None, False)
            }
    call = ChatCall(request=request.model_dump(mode="json", include=set(fields)))
    return Prepared(call, tools, structured or None)


def _parser(cls: Any, card: ModelCard, call: ChatCall, request: Any) -> Any:
    """A parser for one choice of ``call`` (vLLM's ``OpenAIServingChat._make_parser``)."""
    return cls(vllm_tokenizer(card), request.tools, chat_template_kwargs=dict(call.template_kwargs))


def engine_hints(card: ModelCard, call: ChatCall) -> dict[str, Any]:
    """The engine's ``reasoning_ended`` / ``reasoning_parser_kwargs`` for ``call``, as sampling keys.

    vLLM's server passes them to ``generate()`` (``_engine_reasoning_kwargs``)
    when its parser has a reasoning part; with them the engine's structured
    outputs begin where the reasoning ends (at once when the prompt already
    ended it, or ``include_reasoning`` is false). The worker hands them on
    (``workers.engine_config.reasoning_hints``). Empty without a reasoning parser.
    """
    cls = parser_class(card)
    if cls is None or cls.reasoning_parser_cls is None:
        return {}
    # The request after the parser's adjust_request, as a choice's parser has it.
    choice = ChoiceParser(card, call, call.prompt_token_ids)
    hints: dict[str, Any] = {
        "reasoning_parser_kwargs": {"chat_template_kwargs": dict(call.template_kwargs)}
    }
    ended = choice.request.resolve_reasoning_ended(choice.parser, list(call.prompt_token_ids))
    if ended is not None:
        hints["reasoning_ended"] = bool(ended)
    return hints


def merge_delta(first: dict[str, Any] | None, then: dict[str, Any] | None) -> dict[str, Any] | None:
    """Two streamed deltas of a choice as one (a chunk carrying several tokens' deltas).

    Text fields are joined; a tool call continues the one with its ``index``
    (its ``id``, ``type`` and name kept from the first that has them, its
    arguments joined), a new index is appended; None is no delta.
    """
    if first is None or then is None:
        return then if first is None else first
    out = dict(first)
    for key, value in then.items():
        held = out.get(key)
        if key == "tool_calls":
            out[key] = _merge_calls(held or [], value or [])
        elif isinstance(held, str) and isinstance(value, str):
            out[key] = held + value
        elif held is None:
            out[key] = value
    return out


def _merge_calls(first: list[dict[str, Any]], then: list[dict[str, Any]]) -> list[dict[str, Any]]:
    calls = [dict(c) for c in first]
    for call in then:
        same = next((c for c in calls if c.get("index") == call.get("index")), None)
        if same is None:
            calls.append(dict(call))
            continue
        for key, value in call.items():
            if key == "function":
                fn = dict(same.get("function") or {})
                for name, part in (value or {}).items():
                    held = fn.get(name)
                    if name == "arguments" and isinstance(held, str) and isinstance(part, str):
                        fn[name] = held + part
                    elif held is None:
                        fn[name] = part
                same["function"] = fn
            elif same.get(key) is None:
                same[key] = value
    return calls


class ChoiceParser:
    """One choice's output through vLLM's parser (parsers are stateful: one per choice)."""

    def __init__(self, card: ModelCard, call: ChatCall, prompt_token_ids: Sequence[int]) -> None:
        cls = parser_class(card)
        self.request = _vllm_request(card, call.request)
        self.enable_auto_tools = card.enable_auto_tool_choice
        self.has_tool_parser = cls is not None and cls.tool_parser_cls is not None
        self.parser = None
        if cls is not None:
            self.parser = _parser(cls, card, call, self.request)
            self.parser.set_prompt_token_ids(list(prompt_token_ids))
            if self.parser.reasoning_parser is not None or self.request.tool_choice != "none":
                self.request = self.parser.adjust_request(self.request)
        self.prompt_token_ids = list(prompt_token_ids)
        self._prompt_sent = False
        self.tools_streamed = False
        choice = self.request.tool_choice
        self.named = getattr(getattr(choice, "function", None), "name", None)
        self.required = choice == "required"

    @property
    def hides_metadata(self) -> bool:
        """``include_reasoning: false``: vLLM drops the logprobs too (they would show it)."""
        return self.parser is not None and not self.request.include_reasoning

    def delta(self, text: str, token_ids: Sequence[int], finished: bool) -> dict[str, Any] | None:
        """The streamed delta of ``text`` (vLLM's parse_delta), or None to send nothing."""
        if self.parser is None:
            return {"content": text}
        prompt = None
        if not self._prompt_sent:
            self._prompt_sent = True
            prompt = self.prompt_token_ids
        message = self.parser.parse_delta(
            delta_text=text,
            delta_token_ids=list(token_ids),
            request=self.request,
            prompt_token_ids=prompt,
            finished=finished,
        )
        if message is None:
            return None
        if message.tool_calls:
            self.tools_streamed = True
        return self._one_call(message.model_dump(mode="json", exclude_unset=True))

    def reasoning_tokens(self, token_ids: Sequence[int]) -> int:
        """The reasoning tokens among ``token_ids`` (vLLM's ``count_reasoning_tokens``)."""
        if self.parser is None:
            return 0
        return int(self.parser.count_reasoning_tokens(tuple(token_ids)))

    def stream_finish(self, reason: str) -> str:
        """The streamed finish_reason: ``tool_calls`` after tool deltas (not for a named choice)."""
        if self.tools_streamed and self.named is None and reason == "stop":
            return "tool_calls"
        return reason

    def message(
        self, text: str, token_ids: Sequence[int], reason: str
    ) -> tuple[dict[str, Any], str]:
        """The whole choice's message and finish_reason (vLLM's full generator)."""
        if self.parser is None:
            return {"role": "assistant", "content": text}, reason
        from vllm.entrypoints.generate.base.protocol import ToolCall
        from vllm.renderers.chat_utils import make_tool_call_id

        reasoning, content, calls = self.parser.parse(
            text,
            self.request,
            enable_auto_tools=self.enable_auto_tools,
            model_output_token_ids=list(token_ids),
        )
        if not self.request.include_reasoning:
            reasoning = None
        forced = self.named is not None or self.required
        auto_called = False
        message: dict[str, Any] = {"role": "assistant", "reasoning": reasoning}
        if forced:
            message["content"] = content or ""
            message["tool_calls"] = [
                ToolCall(id=c.id or make_tool_call_id(), function=c) for c in calls or []
            ]
        elif (
            self.request.tools
            and self.request.tool_choice in ("auto", None)
            and self.enable_auto_tools
            and self.has_tool_parser
        ):
            auto_called = bool(calls)
            message["content"] = content
            if calls:
                message["tool_calls"] = [
                    ToolCall(id=c.id or make_tool_call_id(), function=c) for c in calls
                ]
        else:
            message["content"] = content
        calls_out = [c.model_dump(mode="json") for c in message.pop("tool_calls", [])]
        if calls_out:
            if self.request.parallel_tool_calls is False:
                calls_out = calls_out[:1]
            message["tool_calls"] = calls_out
        if auto_called or (self.required and reason == "stop"):
            reason = "tool_calls"
        return message, reason

    def _one_call(self, delta: dict[str, Any]) -> dict[str, Any]:
        # vLLM's maybe_filter_parallel_tool_calls on a streamed choice.
        calls = delta.get("tool_calls")
        if calls and self.request.parallel_tool_calls is False:
            delta["tool_calls"] = [c for c in calls if c.get("index", 0) == 0]
            if not delta["tool_calls"]:
                del delta["tool_calls"]
        return delta
