"""prompt_logprobs, echo with logprobs and chat echo on a real cluster (issue 28).

The prompt is computed on the prefill worker, which sends its logprobs
(``star.wire.PromptLogprobs``) with its one token; the proxy renders them as
vLLM's server does. Each response is held to vLLM's own rendering
(``tests.proxy.vllm_logprobs.vllm_prompt_renderer``) of a reference: the same
tiny model run with ``transformers`` in float32 over the prompt, each prompt
token's log-softmax, rank and top k, equal to the engine's within float
tolerance (a rank within the reference's ties at that tolerance).
"""

from __future__ import annotations

import math
from typing import Any

import openai
import pytest

from proxy.tokenizer import ModelCard
from star.fleet import LocalCluster
from star.model import tiny_model_path
from tests.e2e.test_logprobs import MODEL, PROMPT, TOKENS, TOL, close, reference_rows, sdk
from tests.proxy.vllm_logprobs import PromptRender, PromptRow, vllm_prompt_renderer

pytestmark = [
    pytest.mark.engine,
    pytest.mark.timeout(900),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
]

K = 3


@pytest.fixture(scope="module")
def card() -> ModelCard:
    return ModelCard.load(tiny_model_path(), MODEL)


@pytest.fixture(scope="module")
def reference() -> Any:
    from star.model import evaluate

    model, _ = evaluate.load(tiny_model_path())
    return model


@pytest.fixture(scope="module")
def render() -> PromptRender:
    return vllm_prompt_renderer(tiny_model_path())


def prompt_rows(
    model: Any, prompt: list[int], k: int
) -> tuple[list[PromptRow], list[tuple[int, int]]]:
    """Each prompt token's logprob, rank and the top ``k`` after the tokens before it, and the
    ranks it may have at the engine's tolerance (ties within TOL either way)."""
    import torch

    rows: list[PromptRow] = []
    ranks: list[tuple[int, int]] = []
    with torch.inference_mode():
        lps = torch.log_softmax(model(torch.tensor([prompt])).logits[0].float(), -1)
    for i, tid in enumerate(prompt[1:]):
        row = lps[i]
        lp = float(row[tid])
        best = torch.topk(row, k)
        tops = list(zip(best.indices.tolist(), best.values.tolist(), strict=True))
        rank = int((row >= row[tid]).sum())  # vLLM's: the tokens at least as likely
        rows.append((tid, lp, rank, tops))
        ranks.append((int((row > lp + TOL).sum()) + 1, int((row >= lp - TOL).sum())))
    return rows, ranks


def same_prompt_logprobs(
    got: list[Any], want: list[Any], ranks: list[tuple[int, int]], k: int = K
) -> None:
    """The prompt_logprobs field equals the reference's (top ``k``), a rank within its tie
    range."""
    assert len(got) == len(want) and got[0] is None and want[0] is None
    for i, (g, w) in enumerate(zip(got[1:], want[1:], strict=True)):
        assert next(iter(g)) == next(iter(w)), f"position {i + 1}: the prompt token first"
        assert set(g) == set(w), f"position {i + 1}: {g} != {w}"
        lo, hi = ranks[i]
        for tid, entry in g.items():
            ref = w[tid]
            assert entry["decoded_token"] == ref["decoded_token"]
            assert math.isclose(entry["logprob"], ref["logprob"], abs_tol=TOL), (i, tid)
            if tid == next(iter(g)) and ref["rank"] not in range(1, k + 1):
                assert lo <= entry["rank"] <= hi, f"position {i + 1}: rank {entry['rank']}"
            else:
                assert entry["rank"] == ref["rank"], f"position {i + 1}: {entry} != {ref}"


def close_echo(got: dict[str, Any], want: dict[str, Any], where: str) -> None:
    """Echo's logprobs equal: the first prompt token's (no logprobs: null) exactly, the rest
    within tolerance (``close``)."""
    for key in want:
        assert got[key][0] == want[key][0], f"{where}.{key}[0]"
    close({k: v[1:] for k, v in got.items()}, {k: v[1:] for k, v in want.items()}, where)


def test_completion_prompt_logprobs_equal_vllms_for_the_reference(
    cluster: LocalCluster, card: ModelCard, reference: Any, render: PromptRender
) -> None:
    c = sdk(cluster)
    prompt = card.encode(PROMPT)
    raw = c.completions.with_raw_response.create(
        model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0, extra_body={"prompt_logprobs": K}
    )
    (choice,) = raw.http_response.json()["choices"]
    assert choice["logprobs"] is None
    rows, ranks = prompt_rows(reference, prompt, K)
    want = render(prompt, K, rows, [], 0)["prompt_logprobs"]
    same_prompt_logprobs(choice["prompt_logprobs"], want, ranks)
    # Streamed, vLLM refuses prompt logprobs (a 400 naming the parameter).
    with pytest.raises(openai.BadRequestError) as info:
        c.completions.create(
            model=MODEL, prompt=PROMPT, stream=True, extra_body={"prompt_logprobs": 1}
        )
    assert info.value.body["param"] == "prompt_logprobs"  # type: ignore[index]


def test_echo_with_logprobs_equals_vllms_for_the_reference(
    cluster: LocalCluster, card: ModelCard, reference: Any, render: PromptRender
) -> None:
    c = sdk(cluster)
    prompt = card.encode(PROMPT)
    kw: dict[str, Any] = {
        "model": MODEL,
        "prompt": PROMPT,
        "max_tokens": TOKENS,
        "temperature": 0,
        "echo": True,
        "logprobs": K,
    }
    raw = c.completions.with_raw_response.create(**kw)
    (choice,) = raw.http_response.json()["choices"]
    assert choice["text"].startswith(PROMPT)
    rows, ranks = prompt_rows(reference, prompt, K)
    out_rows = reference_rows(reference, prompt, K)
    want = render(prompt, K, rows, out_rows, K)
    lp = choice["logprobs"]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert len(lp["tokens"]) == len(prompt) + len(out_rows)
    close_echo(lp, want["echo"], "echo")
    # echo asks for the prompt's logprobs at k: vLLM shows them in the choice too.
    same_prompt_logprobs(choice["prompt_logprobs"], want["prompt_logprobs"], ranks)

    # Streamed: the first chunk has the prompt and its logprobs, the rest follow.
    parts: dict[str, list[Any]] = {key: [] for key in lp}
    text = ""
    for chunk in c.completions.create(stream=True, **kw):
        (ch,) = chunk.choices
        text += ch.text
        if ch.logprobs is not None:
            for key in parts:
                parts[key].extend(getattr(ch.logprobs, key))
    assert text == choice["text"]
    close_echo(parts, lp, "streamed")

    # max_tokens 0: the prompt and its logprobs alone.
    raw = c.completions.with_raw_response.create(**{**kw, "max_tokens": 0})
    (only,) = raw.http_response.json()["choices"]
    assert only["text"] == PROMPT and len(only["logprobs"]["tokens"]) == len(prompt)
    close_echo(only["logprobs"], {k: v[: len(prompt)] for k, v in lp.items()}, "prompt only")


def test_chat_echo_and_prompt_logprobs(
    cluster: LocalCluster, card: ModelCard, reference: Any, render: PromptRender
) -> None:
    c = sdk(cluster)
    messages: Any = [
        {"role": "user", "content": "give me a tiny list of colors"},
        {"role": "assistant", "content": "teal, red,"},
    ]
    raw = c.chat.completions.with_raw_response.create(
        model=MODEL,
        messages=messages,
        max_tokens=6,
        temperature=0,
        extra_body={"echo": True, "add_generation_prompt": False},
    )
    body = raw.http_response.json()
    message = body["choices"][0]["message"]
    assert message["role"] == "assistant" and message["content"].startswith("teal, red,")
    # vLLM's chat echo asks for the prompt's logprobs at top_logprobs (0): each position
    # the prompt token alone.
    prompt = card.encode_chat(messages, False)
    rows, ranks = prompt_rows(reference, prompt, 0)
    want = render(prompt, 0, rows, [], 0)["prompt_logprobs"]
    assert body["usage"]["prompt_tokens"] == len(prompt)
    same_prompt_logprobs(body["prompt_logprobs"], want, ranks, 0)
    # Streamed: the role chunk, the echoed content, then the new text.
    deltas = [
        ch.choices[0].delta
        for ch in c.chat.completions.create(
            model=MODEL,
            messages=messages,
            max_tokens=6,
            temperature=0,
            stream=True,
            extra_body={"echo": True, "add_generation_prompt": False},
        )
        if ch.choices
    ]
    assert deltas[0].role == "assistant" and deltas[1].content == "teal, red,"
    assert "".join(d.content or "" for d in deltas) == message["content"]
