"""logprobs / top_logprobs through the openai SDK on a real cluster (issue 28).

Greedy completions and chats with logprobs, streamed and not, n > 1: the
sampled token's logprob is the top one, the token strings put together are
the text, and the whole logprobs object is the one vLLM's server code writes
(``tests.proxy.vllm_logprobs``) for the values of a reference: the same
tiny model run with ``transformers`` in float32 (``star.model.evaluate``), its
greedy tokens and their log-softmax, equal to the engine's within float
tolerance. No second engine is started.
"""

from __future__ import annotations

import math
from typing import Any

import openai
import pytest

from proxy.tokenizer import ModelCard
from star.fleet import LocalCluster
from star.model import tiny_model_path
from star.model.task import Prompt
from tests.proxy.vllm_logprobs import Render, Row, vllm_renderer

pytestmark = [
    pytest.mark.engine,
    pytest.mark.timeout(900),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
]

MODEL = "star-tiny"
PROMPT = "give me a tiny list of colors starting with teal."
TOKENS = 24
K = 5
EOS = "<|im_end|>"
TOL = 2e-3  # the engine's fp32 CPU kernels against transformers' eager ones
CHAT_ENTRY = {"token", "logprob", "bytes"}


@pytest.fixture(scope="module")
def card() -> ModelCard:
    return ModelCard.load(tiny_model_path(), MODEL)


@pytest.fixture(scope="module")
def render() -> Render:
    return vllm_renderer(tiny_model_path())


@pytest.fixture(scope="module")
def reference() -> Any:
    from star.model import evaluate

    model, _ = evaluate.load(tiny_model_path())
    return model


def sdk(cluster: LocalCluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{cluster.url}/v1", api_key="unused", max_retries=0, timeout=300)


def reference_rows(model: Any, prompt: list[int], top: int, eos: int = 2) -> list[Row]:
    """Greedy tokens of ``model`` after ``prompt`` and each one's logprobs (top ``top``)."""
    import torch

    ids = list(prompt)
    rows: list[Row] = []
    with torch.inference_mode():
        for _ in range(TOKENS):
            logits = model(torch.tensor([ids])).logits[0, -1].float()
            lps = torch.log_softmax(logits, -1)
            tid = int(torch.argmax(lps))
            best = torch.topk(lps, top)
            tops = list(zip(best.indices.tolist(), best.values.tolist(), strict=True))
            rows.append((tid, float(lps[tid]), tops))
            ids.append(tid)
            if tid == eos:
                break
    return rows


def close(got: Any, want: Any, where: str = "") -> None:
    """``got`` equals ``want``: the same structure and strings, floats within TOL.

    Chat ``top_logprobs`` lists are compared by token (two near-equal logprobs
    may come in either order from two implementations).
    """
    if isinstance(want, dict):
        assert isinstance(got, dict) and set(got) == set(want), f"{where}: {got} != {want}"
        for key in want:
            close(got[key], want[key], f"{where}.{key}")
    elif isinstance(want, list):
        assert isinstance(got, list) and len(got) == len(want), f"{where}: {got} != {want}"
        if where.endswith(".top_logprobs") and want and set(want[0]) == CHAT_ENTRY:
            got = sorted(got, key=lambda e: e["token"])
            want = sorted(want, key=lambda e: e["token"])
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            close(g, w, f"{where}[{i}]")
    elif isinstance(want, float):
        assert isinstance(got, float) and math.isclose(got, want, abs_tol=TOL), (
            f"{where}: {got} != {want}"
        )
    else:
        assert got == want, f"{where}: {got!r} != {want!r}"


def joined(tokens: list[str], text: str) -> None:
    """The token strings make the text (the end token is named but not shown)."""
    if tokens and tokens[-1] == EOS:
        tokens = tokens[:-1]
    assert "".join(tokens) == text


def test_completion_logprobs_equal_vllms_for_the_reference(
    cluster: LocalCluster, card: ModelCard, reference: Any, render: Render
) -> None:
    c = sdk(cluster)
    kw: dict[str, Any] = {"model": MODEL, "prompt": PROMPT, "max_tokens": TOKENS}
    raw = c.completions.with_raw_response.create(temperature=0, logprobs=K, **kw)
    (choice,) = raw.http_response.json()["choices"]
    lp = choice["logprobs"]
    assert list(lp) == ["text_offset", "token_logprobs", "tokens", "top_logprobs"]
    joined(lp["tokens"], choice["text"])
    for i, (token, value, top) in enumerate(
        zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"], strict=True)
    ):
        # Greedy: the sampled token is the top one. (Two ids named alike, e.g. two
        # partial characters "", share one key, the later one's value: fewer keys.)
        assert value >= max(top.values())
        if len(top) == K:
            assert value == max(top.values()) == top[token]
        assert lp["text_offset"][i] == sum(len(t) for t in lp["tokens"][:i])
    rows = reference_rows(reference, card.encode(PROMPT), K)
    close(lp, render(False, K, rows), "logprobs")

    # Streamed: each chunk's logprobs, put together, are the same object.
    parts: dict[str, list[Any]] = {key: [] for key in lp}
    text = ""
    for chunk in c.completions.create(temperature=0, logprobs=K, stream=True, **kw):
        (ch,) = chunk.choices
        text += ch.text
        if ch.logprobs is not None:  # every chunk but one that only ends the choice
            for key in parts:
                parts[key].extend(getattr(ch.logprobs, key))
    assert text == choice["text"]
    close(parts, lp, "streamed")

    # The SDK reads it as its own type.
    resp = c.completions.create(temperature=0, logprobs=0, **kw)
    typed = resp.choices[0].logprobs
    assert typed is not None and typed.tokens == lp["tokens"]
    assert typed.top_logprobs == [
        {t: v} for t, v in zip(typed.tokens, typed.token_logprobs or [], strict=True)
    ]


def test_chat_logprobs_equal_vllms_for_the_reference(
    cluster: LocalCluster, card: ModelCard, reference: Any, render: Render
) -> None:
    c = sdk(cluster)
    messages: Any = Prompt(topic="animals", size="short", start="owl").messages()
    kw: dict[str, Any] = {"model": MODEL, "messages": messages, "max_tokens": TOKENS}
    raw = c.chat.completions.with_raw_response.create(
        temperature=0, logprobs=True, top_logprobs=K, **kw
    )
    (choice,) = raw.http_response.json()["choices"]
    content = choice["logprobs"]["content"]
    joined([e["token"] for e in content], choice["message"]["content"])
    for entry in content:
        assert list(entry) == ["token", "logprob", "bytes", "top_logprobs"]
        assert entry["bytes"] == list(entry["token"].encode())
        first = entry["top_logprobs"][0]
        assert len(entry["top_logprobs"]) == K
        assert (first["token"], first["logprob"]) == (entry["token"], entry["logprob"])
        assert entry["logprob"] == max(e["logprob"] for e in entry["top_logprobs"])
    rows = reference_rows(reference, card.encode_chat(messages, True), K)
    close(choice["logprobs"], render(True, K, rows), "logprobs")

    entries: list[Any] = []
    text = ""
    for chunk in c.chat.completions.create(
        temperature=0, logprobs=True, top_logprobs=K, stream=True, **kw
    ):
        (ch,) = chunk.choices
        text += ch.delta.content or ""
        if ch.delta.role is not None:
            assert ch.logprobs is None  # the role chunk
            continue
        if ch.logprobs is not None:  # every chunk but one that only ends the choice
            entries.extend(e.model_dump() for e in ch.logprobs.content or [])
    assert text == choice["message"]["content"]
    close({"content": entries}, choice["logprobs"], "streamed")

    # logprobs without top_logprobs: each token's own, an empty top list.
    plain = c.chat.completions.create(temperature=0, logprobs=True, **kw)
    assert plain.choices[0].logprobs is not None and plain.choices[0].logprobs.content
    assert [(e.token, e.top_logprobs) for e in plain.choices[0].logprobs.content] == [
        (e["token"], []) for e in content
    ]


def test_each_of_n_choices_carries_its_logprobs(cluster: LocalCluster) -> None:
    c = sdk(cluster)
    kw: dict[str, Any] = {
        "model": MODEL,
        "prompt": PROMPT,
        "max_tokens": TOKENS,
        "temperature": 0,
        "logprobs": 2,
    }
    one = c.completions.with_raw_response.create(**kw).http_response.json()["choices"][0]
    # vLLM 0.32 refuses greedy n > 1; top_k 1 samples the greedy tokens (logprobs are the raw ones).
    greedy_n = {**kw, "temperature": 1.0, "extra_body": {"top_k": 1}}
    two = c.completions.with_raw_response.create(n=2, **greedy_n).http_response.json()["choices"]
    assert [ch["index"] for ch in two] == [0, 1]
    for ch in two:
        assert ch["text"] == one["text"]
        close(ch["logprobs"], one["logprobs"], f"choice {ch['index']}")


@pytest.mark.parametrize(
    ("kind", "fields", "param"),
    [
        ("completion", {"logprobs": 21}, "logprobs"),
        ("completion", {"prompt_logprobs": 21}, "prompt_logprobs"),
        ("chat", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ("chat", {"top_logprobs": 2}, "top_logprobs"),
    ],
)
def test_out_of_bounds_is_a_400(
    cluster: LocalCluster, kind: str, fields: dict[str, Any], param: str
) -> None:
    c = sdk(cluster)
    with pytest.raises(openai.BadRequestError) as info:
        if kind == "chat":
            c.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "hi"}], extra_body=fields
            )
        else:
            c.completions.create(model=MODEL, prompt=PROMPT, extra_body=fields)
    assert info.value.status_code == 400
    body: Any = info.value.body
    assert body["param"] == param
