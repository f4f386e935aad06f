"""The served model as the proxy sees it: tokenizer, chat template, limits.

Loaded once at start from a Hugging Face style model directory
(``tokenizer.json``, ``tokenizer_config.json`` with ``chat_template`` or a
``chat_template.jinja`` file, optionally ``config.json`` and
``generation_config.json``). The chat template is rendered with jinja2 the way
``transformers``' ``apply_chat_template`` does (same sandbox, filters and
globals), without importing ``transformers`` (seconds of start-up and a torch
dependency the proxy does not need).

Tokenising costs about a microsecond per byte, so a prompt far longer than the
context is refused on its length in bytes before it is tokenised, where the
tokenizer allows a sound bound (:func:`bytes_per_token`).
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from functools import cached_property
from pathlib import Path
from typing import Any, NoReturn

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer, pre_tokenizers

DEFAULT_MAX_MODEL_LEN = 2048
# Sampling defaults a model may ship in generation_config.json; vLLM's OpenAI
# server applies the same keys when the request leaves them out.
_GENERATION_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


class ChatTemplateError(ValueError):
    """The messages cannot be rendered (no template, or the template refused them)."""


def as_conversation(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The messages as vLLM 0.32 hands them to a chat template (string content format).

    What an agent's next turn sends back: an assistant message whose
    ``content`` is null (a tool call without text) renders with ``""``, and
    each of its ``tool_calls``' ``arguments`` as an object, parsed from its
    JSON string ({} when it is empty, malformed or not an object), the empty
    list dropped (``_parse_chat_message_content`` and
    ``_postprocess_messages`` in ``vllm/renderers/chat_utils.py``). The input
    is left as it is.
    """
    out = []
    for message in messages:
        msg = dict(message)
        if msg.get("content") is None:
            msg["content"] = ""
        calls = msg.get("tool_calls")
        if msg.get("role") == "assistant" and isinstance(calls, list):
            if not calls:
                del msg["tool_calls"]
            else:
                msg["tool_calls"] = [_with_parsed_arguments(call) for call in calls]
        out.append(msg)
    return out


CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "
"""transformers' marker of where a continued final message ends (``continue_final_message_tag``)."""


def _tag_final_message(conversation: list[dict[str, Any]]) -> str:
    """Append :data:`CONTINUE_TAG` to the last message's text (its last text part); that text."""
    last = conversation[-1] = dict(conversation[-1])
    content = last.get("content")
    if isinstance(content, str):
        last["content"] = content + CONTINUE_TAG
        return content
    if isinstance(content, list | tuple):
        parts = [dict(p) if isinstance(p, Mapping) else p for p in content]
        for part in reversed(parts):
            if isinstance(part, dict) and "text" in part:
                text = str(part["text"])
                part["text"] = text + CONTINUE_TAG
                last["content"] = parts
                return text
    raise ChatTemplateError(
        "continue_final_message is set but we could not find any text to continue "
        "in the final message!"
    )


def _with_parsed_arguments(call: Any) -> dict[str, Any]:
    # vLLM's VLLMValidationError messages (a 400 either way).
    if not isinstance(call, dict):
        raise ChatTemplateError("assistant tool_calls entries must be objects.")
    function = call.get("function")
    if call.get("type", "function") != "function" or not isinstance(function, dict):
        raise ChatTemplateError(
            "chat completions only support assistant tool_calls of type 'function'."
        )
    parsed = arguments = function.get("arguments")
    if isinstance(arguments, str) and arguments:
        try:
            parsed = json.loads(arguments)
        except json.JSONDecodeError:
            parsed = None
    if not isinstance(parsed, dict):
        parsed = {}
    return {**call, "function": {**function, "arguments": parsed}}


class ModelLoadError(RuntimeError):
    """The model directory lacks what the proxy needs, or it is malformed."""


class PromptTooLong(ValueError):
    """A prompt refused on its size alone: it has more than ``min_tokens`` tokens for sure."""

    def __init__(self, min_tokens: int, size_bytes: int) -> None:
        super().__init__(f"at least {min_tokens} tokens ({size_bytes} bytes)")
        self.min_tokens = min_tokens
        self.size_bytes = size_bytes


@dataclass(frozen=True, slots=True)
class Truncation:
    """vLLM's ``truncate_prompt_tokens`` / ``truncation_side``: a prompt keeps ``keep`` tokens.

    ``side`` None is the tokenizer's, which vLLM sets to ``"left"`` for
    generation (the last tokens kept); vLLM then truncates a text prompt in
    the tokenizer (special tokens kept, the text's tokens cut), and with an
    explicit side the whole encoding (``TokenizeParams`` in
    ``vllm/renderers/params.py``).
    """

    keep: int
    side: str | None = None

    def ids(self, ids: list[int]) -> list[int]:
        """``ids`` truncated (vLLM's ``_token_truncation``)."""
        if self.keep >= len(ids):
            return ids
        if self.keep == 0:
            return []
        return ids[-self.keep :] if (self.side or "left") == "left" else ids[: self.keep]


@dataclass(frozen=True, eq=False)
class ModelCard:
    """One served model: the name clients use plus everything needed to (de)tokenise."""

    name: str
    tokenizer: Tokenizer
    chat_template: str | None = None
    special_tokens: Mapping[str, str] = field(default_factory=dict)
    max_model_len: int = DEFAULT_MAX_MODEL_LEN
    generation_defaults: Mapping[str, Any] = field(default_factory=dict)
    created: int = field(default_factory=lambda: int(time.time()))
    owned_by: str = "star"
    # Where ``tokenizer`` was read from: a worker process loads it from there
    # (see __reduce__) instead of being sent its JSON.
    tokenizer_file: str | None = None
    # vLLM's --reasoning-parser, --tool-call-parser and --enable-auto-tool-choice
    # for this model (proxy.chat_tools; set from the proxy's settings).
    reasoning_parser: str = ""
    tool_call_parser: str = ""
    enable_auto_tool_choice: bool = False
    # The most bytes of prompt text one token can stand for, or None when the
    # tokenizer allows no such bound (see bytes_per_token).
    max_bytes_per_token: int | None = field(init=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "max_bytes_per_token", bytes_per_token(self.tokenizer))

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickled for a worker process: the fields, and the tokenizer by its file if known."""
        fields = {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)
            if f.init and f.name != "tokenizer"
        }
        source = self.tokenizer_file or self.tokenizer.to_str()
        return (_unpickle_card, (source, self.tokenizer_file is not None, fields))

    @classmethod
    def load(
        cls, path: str | Path, name: str | None = None, max_model_len: int | None = None
    ) -> ModelCard:
        """Read a model directory; ``name`` defaults to ``path`` as given (as vLLM does)."""
        root = Path(path)
        tok_file = root / "tokenizer.json"
        if not tok_file.is_file():
            raise ModelLoadError(f"{str(root)!r} has no tokenizer.json")
        try:
            tokenizer = _read_tokenizer(str(tok_file), from_file=True)
        except Exception as exc:  # tokenizers raises plain Exceptions
            raise ModelLoadError(f"{str(tok_file)!r} is not a valid tokenizer: {exc}") from exc
        config = _read_json(root / "tokenizer_config.json")
        template = _chat_template(root, config)
        special = {
            key: text
            for key in ("bos_token", "eos_token", "unk_token", "pad_token")
            if (text := _token_text(config.get(key))) is not None
        }
        gen = _read_json(root / "generation_config.json")
        defaults = {k: gen[k] for k in _GENERATION_KEYS if gen.get(k) is not None}
        return cls(
            name=str(path) if name is None else name,
            tokenizer=tokenizer,
            chat_template=template,
            special_tokens=special,
            max_model_len=max_model_len or _max_len(root, config),
            generation_defaults=defaults,
            tokenizer_file=str(tok_file.resolve()),
        )

    def encode(
        self, text: str, truncate: Truncation | None = None, add_special_tokens: bool = True
    ) -> list[int]:
        """Token ids of a completion prompt (with the tokenizer's BOS etc., like vLLM,
        unless ``add_special_tokens`` is off).

        Raises :class:`PromptTooLong`, without tokenising, for a text too long
        in bytes to fit the context whatever its tokens (unless ``truncate``).
        """
        if truncate is not None:
            return self._truncated(text, truncate, add_special_tokens)
        self.check_size(text)
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids)

    def _truncated(self, text: str, truncate: Truncation, add_special_tokens: bool) -> list[int]:
        """The ids of ``text`` truncated as vLLM truncates a text prompt.

        A text longer than any ``max_model_len`` tokens can be is cut to that
        many characters first, on the side truncation cuts (vLLM does so with
        an explicit side; here always, so that tokenising stays bounded).
        """
        side = truncate.side or "left"
        if self.max_bytes_per_token is not None:
            bound = self.max_model_len * self.max_bytes_per_token
            if len(text) > bound:
                text = text[-bound:] if side == "left" else text[:bound]
        tok = self.tokenizer
        specials = tok.num_special_tokens_to_add(False) if add_special_tokens else 0
        if truncate.side is not None:
            return truncate.ids(list(tok.encode(text, add_special_tokens=add_special_tokens).ids))
        enc = tok.encode(text, add_special_tokens=False)
        enc.truncate(max(truncate.keep - specials, 0), direction="left")  # the specials stay
        return truncate.ids(list(tok.post_process(enc, add_special_tokens=add_special_tokens).ids))

    def check_size(self, text: str) -> None:
        """Raise :class:`PromptTooLong` if ``text`` has more than ``max_model_len`` tokens for sure.

        A token stands for at most ``max_bytes_per_token`` bytes of text, so a
        text of more than ``max_model_len * max_bytes_per_token`` bytes has
        more tokens than the context holds. Costs at most one UTF-8 encode.
        """
        per_token = self.max_bytes_per_token
        if per_token is None:
            return
        limit = self.max_model_len * per_token
        if len(text) * 4 <= limit:
            return  # a character is at most 4 bytes
        size = len(text.encode("utf-8", "surrogatepass"))
        if size > limit:
            raise PromptTooLong(math.ceil(size / per_token), size)

    def render_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        **kwargs: Any,
    ) -> str:
        """The prompt text of a conversation, through the model's chat template.

        ``continue_final_message``: the text ends inside the last message, right
        after its content, so the model goes on writing it (transformers'
        ``apply_chat_template``, which vLLM calls: a tag appended to the content
        marks where to cut the rendered text).
        """
        if self._compiled is None:
            raise ChatTemplateError("this model has no chat template; use /v1/completions")
        conversation = as_conversation(messages)
        final = ""
        if continue_final_message:
            final = _tag_final_message(conversation)
        try:
            text = self._compiled.render(
                messages=conversation,
                add_generation_prompt=add_generation_prompt,
                **{**self.special_tokens, **kwargs},
            )
        except ChatTemplateError:
            raise
        except Exception as exc:  # a template is code: None + str and the like end up here
            raise ChatTemplateError(f"chat template failed: {exc}") from exc
        if not continue_final_message:
            return text
        if final.strip() not in text or CONTINUE_TAG.strip() not in text:
            raise ChatTemplateError(
                "continue_final_message is set but the final message does not appear in the "
                "chat after applying the chat template"
            )
        at = text.rindex(CONTINUE_TAG.strip())
        if text[at : at + len(CONTINUE_TAG)] == CONTINUE_TAG:
            return text[:at]
        return text[:at].rstrip()  # the template trimmed the content's trailing space

    def encode_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        **kwargs: Any,
    ) -> list[int]:
        """Token ids of a conversation; the template supplies BOS, so none is added.

        Raises :class:`PromptTooLong` as :meth:`encode` does, on the rendered text.
        """
        text = self.render_chat(messages, add_generation_prompt, continue_final_message, **kwargs)
        return self.encode_rendered(text)

    def encode_rendered(
        self, text: str, truncate: Truncation | None = None, add_special_tokens: bool = False
    ) -> list[int]:
        """Token ids of a rendered conversation (:meth:`render_chat`; the template has
        the special tokens, so none is added unless asked); as :meth:`encode` otherwise."""
        return self.encode(text, truncate, add_special_tokens)

    @cached_property
    def _compiled(self) -> jinja2.Template | None:
        return None if self.chat_template is None else compile_template(self.chat_template)


def compile_template(source: str) -> jinja2.Template:
    """Compile a chat template in transformers' sandbox (raises ChatTemplateError)."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(source)
    except jinja2.TemplateError as exc:
        raise ChatTemplateError(f"chat template does not compile: {exc}") from exc


# How many times fewer UTF-8 bytes a normalizer can leave of a text (None: no
# bound, as with one that strips or collapses characters). Unicode forms: the
# largest ratio over every code point and composition (U+212A KELVIN SIGN ->
# "K", a Hangul syllable from three jamo: 3; U+1FBF9 -> "9" under NFKC: 4);
# tests/proxy/test_prompt_size.py checks these against unicodedata.
_SHRINK = {"NFC": 3, "NFD": 3, "NFKC": 4, "NFKD": 4, "Lowercase": 3, "Prepend": 1, "ByteLevel": 1}
# Pre-tokenizers that keep every byte of the text (they split, map or add).
_KEEPING = {"ByteLevel", "Metaspace", "Digits", "UnicodeScripts", "Split", "Punctuation"}


def bytes_per_token(tokenizer: Tokenizer) -> int | None:
    """The most bytes of input text one token of ``tokenizer`` can stand for, if bounded.

    Sound only where the pipeline drops nothing: every byte of the normalised
    text ends up in some token. That holds for a BPE model that is byte-level
    (with all 256 byte symbols), has byte fallback (all 256 ``<0xNN>``
    tokens), or maps each unknown character to its own unknown token; behind
    normalizers that shrink text by a bounded factor and pre-tokenizers that
    remove nothing; with added tokens that absorb no whitespace. Then a token
    covers at most its own length (in bytes; a byte-level symbol is one byte,
    an unknown token one character, at most 4) of the normalised text, which
    is at least the input's length divided by the normalizer's factor.
    Anything else (WordPiece, Unigram, a Strip or Replace-by-regex normalizer,
    a whitespace-dropping pre-tokenizer) gives None: no size check.
    """
    spec = json.loads(tokenizer.to_str())
    model = spec.get("model") or {}
    if model.get("type") != "BPE":
        return None
    shrink = _shrink(spec.get("normalizer"))
    pre = spec.get("pre_tokenizer")
    if shrink is None or not _keeps_bytes(pre):
        return None
    vocab: dict[str, int] = model.get("vocab") or {}
    if _has(pre, "ByteLevel") and all(c in vocab for c in pre_tokenizers.ByteLevel.alphabet()):
        longest = max(map(len, vocab), default=1)  # one symbol per byte
    elif model.get("byte_fallback") and all(f"<0x{b:02X}>" in vocab for b in range(256)):
        longest = max((len(t.encode()) for t in vocab), default=1)
    elif model.get("unk_token") in vocab and not model.get("fuse_unk"):
        longest = max(4, max((len(t.encode()) for t in vocab), default=1))
    else:
        return None  # characters outside the vocabulary would vanish
    for added in spec.get("added_tokens") or []:
        if added.get("lstrip") or added.get("rstrip"):
            return None  # it swallows the whitespace next to it, however long
        longest = max(longest, len(str(added.get("content", "")).encode()))
    return longest * shrink


def _shrink(normalizer: Mapping[str, Any] | None) -> int | None:
    if normalizer is None:
        return 1
    kind = normalizer.get("type")
    if kind == "Sequence":
        factor = 1
        for part in normalizer.get("normalizers") or []:
            step = _shrink(part)
            if step is None:
                return None
            factor *= step
        return factor
    if kind == "Replace":
        pattern, content = normalizer.get("pattern") or {}, normalizer.get("content")
        literal = pattern.get("String")
        if not isinstance(literal, str) or not isinstance(content, str) or not content:
            return None  # a regex can match any length
        return max(1, math.ceil(len(literal.encode()) / len(content.encode())))
    return _SHRINK.get(str(kind))


def _keeps_bytes(pre: Mapping[str, Any] | None) -> bool:
    if pre is None:
        return True
    if pre.get("type") == "Sequence":
        return all(_keeps_bytes(p) for p in pre.get("pretokenizers") or [])
    return pre.get("type") in _KEEPING and pre.get("behavior") != "Removed"


def _has(pre: Mapping[str, Any] | None, kind: str) -> bool:
    if pre is None:
        return False
    if pre.get("type") == "Sequence":
        return any(_has(p, kind) for p in pre.get("pretokenizers") or [])
    return pre.get("type") == kind


def _read_tokenizer(source: str, *, from_file: bool) -> Tokenizer:
    tokenizer = Tokenizer.from_file(source) if from_file else Tokenizer.from_str(source)
    # A tokenizer.json saved with truncation/padding on would silently cut prompts.
    tokenizer.no_truncation()
    tokenizer.no_padding()
    return tokenizer


def _unpickle_card(source: str, from_file: bool, fields: dict[str, Any]) -> ModelCard:
    return ModelCard(tokenizer=_read_tokenizer(source, from_file=from_file), **fields)


def _raise(message: str) -> NoReturn:
    raise ChatTemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: Any = None,
    sort_keys: bool = False,
) -> str:
    # transformers' tojson: unlike jinja's built-in, no HTML escaping.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"{str(path)!r} is not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise ModelLoadError(f"{str(path)!r} must hold a JSON object")
    return data


def _chat_template(root: Path, config: Mapping[str, Any]) -> str | None:
    jinja_file = root / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default") or next(iter(named.values()), None)
    return template if isinstance(template, str) else None


def _token_text(value: Any) -> str | None:
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return str(value["content"])  # a serialised AddedToken
    return None


def _max_len(root: Path, config: Mapping[str, Any]) -> int:
    model_config = _read_json(root / "config.json")
    for value in (model_config.get("max_position_embeddings"), config.get("model_max_length")):
        # transformers writes model_max_length = 1e30 when unknown.
        if isinstance(value, int | float) and 0 < value < 10_000_000:
            return int(value)
    return DEFAULT_MAX_MODEL_LEN
