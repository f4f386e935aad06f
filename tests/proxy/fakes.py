"""Test doubles: a tokenizer built on the spot, a model directory, a scripted Backend."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from proxy.backend import BackendError, FinishReason, GenerationRequest, TokenBatch
from proxy.decode_run import Migrator
from star.wire import Decision

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
CORPUS = [
    "hello world, the quick brown fox jumps over the lazy dog. Once upon a time there was a proxy.",
    "héllo wörld ça va? 你好世界, こんにちは, 😀🎉👍 naïve café résumé Ünïcödé ß ñ € ∑ √ ∞",
    "The answer is 42. STOP here. Done!\nNew line\tand tab",
]


def build_tokenizer() -> Tokenizer:
    """A small byte-level BPE (GPT-2 style) whose merges cover multi-byte characters."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=600,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(CORPUS * 20, trainer)
    return tok


def write_model_dir(root: Path, tok: Tokenizer, max_len: int = 512) -> Path:
    """A Hugging Face style directory: tokenizer.json, tokenizer_config.json, config.json."""
    root.mkdir(parents=True, exist_ok=True)
    tok.save(str(root / "tokenizer.json"))
    config = {
        "chat_template": CHATML,
        "eos_token": "<|im_end|>",
        "bos_token": None,
        "model_max_length": 1_000_000_000_000_000_019_884_624_838_656,
    }
    (root / "tokenizer_config.json").write_text(json.dumps(config))
    (root / "config.json").write_text(json.dumps({"max_position_embeddings": max_len}))
    return root


@dataclass
class Script:
    """How the fake backend answers one request."""

    text: str = "The answer is 42."
    finish_reason: FinishReason = "stop"
    delay_s: float = 0.0  # between batches
    tokens_per_batch: int = 1
    hang_after: int | None = None  # stop producing (until cancelled) after this many tokens
    fail_before: BackendError | None = None
    fail_after: tuple[int, Exception] | None = None
    end_without_finish: bool = False


@dataclass
class Call:
    """What the fake backend saw of one request."""

    req: GenerationRequest
    sent: int = 0
    outcome: str = "running"  # finished | cancelled | closed | failed
    done: asyncio.Event = field(default_factory=asyncio.Event)


class FakeBackend:
    """Yields the token ids of a scripted answer; records how each stream ended."""

    def __init__(
        self, tok: Tokenizer, script: Script | Callable[[GenerationRequest], Script] | None = None
    ) -> None:
        self.tok = tok
        self.script = script or Script()
        self.calls: list[Call] = []
        self.ok = True

    def health(self) -> dict[str, Any]:
        return {"ok": self.ok, "backend": "fake", "calls": len(self.calls)}

    async def generate(self, req: GenerationRequest) -> AsyncIterator[TokenBatch]:
        script = self.script(req) if callable(self.script) else self.script
        call = Call(req)
        self.calls.append(call)
        try:
            if script.fail_before is not None:
                raise script.fail_before
            ids = self.tok.encode(script.text, add_special_tokens=False).ids
            reason: FinishReason = script.finish_reason
            if len(ids) >= req.max_tokens:
                ids, reason = ids[: req.max_tokens], "length"
            for index in range(req.n):
                pos = 0
                while pos < len(ids):
                    if script.hang_after is not None and pos >= script.hang_after:
                        await asyncio.Event().wait()
                    if script.fail_after is not None and pos >= script.fail_after[0]:
                        raise script.fail_after[1]
                    chunk = ids[pos : pos + script.tokens_per_batch]
                    pos += len(chunk)
                    last = pos >= len(ids) and not script.end_without_finish
                    call.sent += len(chunk)
                    if last and reason == "stop":
                        # The script's text ends on its own last token, not on a stop
                        # token (vLLM's engine stops on EOS or a stop token id, whose text
                        # the proxy leaves out): the stop comes after it, without tokens.
                        yield TokenBatch(chunk, None, None, index)
                        await asyncio.sleep(0)
                        yield TokenBatch([], reason, None, index)
                    else:
                        yield TokenBatch(chunk, reason if last else None, None, index)
                    if script.delay_s:
                        await asyncio.sleep(script.delay_s)
                    else:
                        await asyncio.sleep(0)
            call.outcome = "finished"
        except asyncio.CancelledError:
            call.outcome = "cancelled"
            raise
        except GeneratorExit:
            call.outcome = "closed"
            raise
        except Exception:
            call.outcome = "failed"
            raise
        finally:
            call.done.set()


class Recorder(Migrator):
    """A migrator that records the id of every decision handed to it (and applies none)."""

    def __init__(self) -> None:
        super().__init__({}, lambda _t: None, lambda _e: None, "proxy:test")
        self.applied: list[str] = []

    def apply(self, decision: Decision) -> str | None:
        self.applied.append(decision.id)
        return None
