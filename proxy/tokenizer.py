"""The served model as the proxy sees it: tokenizer, chat template, limits.

Loaded once at start from a Hugging Face style model directory
(``tokenizer.json``, ``tokenizer_config.json`` with ``chat_template`` or a
``chat_template.jinja`` file, optionally ``config.json`` and
``generation_config.json``). The chat template is rendered with jinja2 the way
``transformers``' ``apply_chat_template`` does (same sandbox, filters and
globals), without importing ``transformers`` (seconds of start-up and a torch
dependency the proxy does not need).
"""

from __future__ import annotations

import json
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
from tokenizers import Tokenizer

DEFAULT_MAX_MODEL_LEN = 2048
# Sampling defaults a model may ship in generation_config.json; vLLM's OpenAI
# server applies the same keys when the request leaves them out.
_GENERATION_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


class ChatTemplateError(ValueError):
    """The messages cannot be rendered (no template, or the template refused them)."""


class ModelLoadError(RuntimeError):
    """The model directory lacks what the proxy needs, or it is malformed."""


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
            tokenizer = Tokenizer.from_file(str(tok_file))
        except Exception as exc:  # tokenizers raises plain Exceptions
            raise ModelLoadError(f"{str(tok_file)!r} is not a valid tokenizer: {exc}") from exc
        # A tokenizer.json saved with truncation/padding on would silently cut prompts.
        tokenizer.no_truncation()
        tokenizer.no_padding()
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
        )

    def encode(self, text: str) -> list[int]:
        """Token ids of a completion prompt (with the tokenizer's BOS etc., like vLLM)."""
        return list(self.tokenizer.encode(text, add_special_tokens=True).ids)

    def render_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        **kwargs: Any,
    ) -> str:
        """The prompt text of a conversation, through the model's chat template."""
        if self._compiled is None:
            raise ChatTemplateError("this model has no chat template; use /v1/completions")
        try:
            return self._compiled.render(
                messages=list(messages),
                add_generation_prompt=add_generation_prompt,
                **{**self.special_tokens, **kwargs},
            )
        except ChatTemplateError:
            raise
        except Exception as exc:  # a template is code: None + str and the like end up here
            raise ChatTemplateError(f"chat template failed: {exc}") from exc

    def encode_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        **kwargs: Any,
    ) -> list[int]:
        """Token ids of a conversation; the template supplies BOS, so none is added."""
        text = self.render_chat(messages, add_generation_prompt, **kwargs)
        return list(self.tokenizer.encode(text, add_special_tokens=False).ids)

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
