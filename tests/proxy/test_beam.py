"""Beam search (issue 28): STAR's loop against vLLM 0.32's own, on the same model.

The model is made up: a token's logprob is a function of the sequence before
it, over a 12-token vocabulary, rounded so that candidates tie often (the
tie-breaking is vLLM's numpy calls', which :mod:`proxy.beam` copies). vLLM's
``BeamSearchOnlineMixin.beam_search`` runs over an engine client that answers
each one-token request from it; STAR's :func:`proxy.beam.search` over a step
that answers the same as a worker's token batch. The beams, their cumulative
logprobs and their ends must be the same.
"""

from __future__ import annotations

import asyncio
import hashlib
import math
from types import SimpleNamespace
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from proxy.backend import TokenBatch
from proxy.beam import BeamParams, search

VOCAB, EOS = 12, 2

pytestmark = [
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
]


def logprobs(tokens: list[int], salt: int) -> list[float]:
    """The made-up model: log-softmax of hashed scores, rounded (ties)."""
    digest = hashlib.sha256(f"{salt}:{tokens}".encode()).digest()
    raw = [round(digest[i] / 255.0 * 3, 1) for i in range(VOCAB)]
    norm = math.log(sum(math.exp(r) for r in raw))
    return [r - norm for r in raw]


def ranked(tokens: list[int], salt: int, k: int) -> tuple[int, list[tuple[int, float]]]:
    """The greedy token and the top ``k`` (id, logprob), as a sampler ranks them."""
    lp = logprobs(tokens, salt)
    order = sorted(range(VOCAB), key=lambda t: (-lp[t], t))
    return order[0], [(t, lp[t]) for t in order[:k]]


def vllm_beams(prompt: list[int], params: BeamParams, salt: int) -> list[tuple[Any, ...]]:
    from vllm.entrypoints.generate.beam_search.online import BeamSearchOnlineMixin
    from vllm.logprobs import Logprob
    from vllm.outputs import CompletionOutput, RequestOutput
    from vllm.sampling_params import BeamSearchParams

    class Engine:
        input_processor = SimpleNamespace(resolve_watermarking=lambda p: None)

        async def generate(self, item: Any, sampling: Any, request_id: str, **_: Any) -> Any:
            tokens = list(item["prompt_token_ids"])
            sampled, top = ranked(tokens, salt, sampling.logprobs)
            entry = {sampled: Logprob(dict(top)[sampled], 1, None)}
            for rank, (tid, lp) in enumerate(top, start=1):
                entry[tid] = Logprob(lp, rank, None)
            out = CompletionOutput(0, "", [sampled], None, [entry], finish_reason="length")
            yield RequestOutput(request_id, None, tokens, None, [out], finished=True)

    tokenizer = SimpleNamespace(eos_token_id=EOS, decode=lambda ids, **_: "")
    server = SimpleNamespace(
        engine_client=Engine(), renderer=SimpleNamespace(get_tokenizer=lambda: tokenizer)
    )
    vparams = BeamSearchParams(
        beam_width=params.width,
        max_tokens=params.max_tokens,
        ignore_eos=params.ignore_eos,
        temperature=0.0,
        length_penalty=params.length_penalty,
        include_stop_str_in_output=params.include_stop_str_in_output,
    )

    async def run() -> list[Any]:
        gen = BeamSearchOnlineMixin.beam_search(
            server,  # type: ignore[arg-type]
            {"type": "token", "prompt_token_ids": prompt},
            "r",
            vparams,
        )
        return [o async for r in gen for o in r.outputs]

    return [
        (list(o.token_ids), o.cumulative_logprob, o.finish_reason, o.stop_reason)
        for o in asyncio.run(run())
    ]


def star_beams(prompt: list[int], params: BeamParams, salt: int) -> list[tuple[Any, ...]]:
    async def step(tokens: list[int]) -> TokenBatch:
        k = int(params.sampling()["logprobs"])
        sampled, top = ranked(tokens, salt, k)
        return TokenBatch(
            [sampled],
            "length",
            logprobs=[dict(top)[sampled]],
            top_ids=[t for t, _ in top],
            top_logprobs=[lp for _, lp in top],
        )

    beams = asyncio.run(search(prompt, params, EOS, step))
    return [
        (b.tokens[len(prompt) :], b.cum_logprob, b.finish_reason or "length", b.stop_reason)
        for b in beams
    ]


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    prompt=st.lists(st.integers(3, VOCAB - 1), min_size=1, max_size=4),
    width=st.integers(1, 4),
    max_tokens=st.integers(1, 6),
    penalty=st.sampled_from([1.0, 0.5, 2.0]),
    ignore_eos=st.booleans(),
    include_stop=st.booleans(),
    salt=st.integers(0, 10_000),
)
def test_the_same_beams_as_vllms_beam_search(
    prompt: list[int],
    width: int,
    max_tokens: int,
    penalty: float,
    ignore_eos: bool,
    include_stop: bool,
    salt: int,
) -> None:
    params = BeamParams(width, max_tokens, ignore_eos, 0.0, penalty, include_stop)
    assert star_beams(prompt, params, salt) == vllm_beams(prompt, params, salt)


class _Model:
    """A backend whose one-token answers come from the made-up model (the fleet's part)."""

    def __init__(self, salt: int) -> None:
        self.salt = salt
        self.requests: list[Any] = []

    async def generate(self, req: Any) -> Any:
        self.requests.append(req)
        k = int(req.sampling["logprobs"])
        sampled, top = ranked(list(req.prompt_token_ids), self.salt, k)
        yield TokenBatch(
            [sampled],
            "length",
            logprobs=[dict(top)[sampled]],
            top_ids=[t for t, _ in top],
            top_logprobs=[lp for _, lp in top],
        )


@pytest.mark.parametrize("salt", [1, 2, 3])
def test_a_beam_search_completion_answers_as_vllms_server(card: Any, salt: int) -> None:
    """use_beam_search on /v1/completions: the width is n, one choice a beam in vLLM's
    order (each prompt's own search), each beam's text its tokens decoded alone, the end
    token left out; every step an ordinary one-token request with 2 x width logprobs."""
    import json

    from proxy.app import ProxyApp
    from proxy.openai import parse_completion
    from star.settings import ProxySettings

    body = {"model": "tiny", "prompt": [[5, 6], [7]], "n": 2, "max_tokens": 4}
    body |= {"use_beam_search": True, "temperature": 0, "stop": ["never"]}
    parsed = parse_completion(json.dumps(body).encode(), {"tiny": card})
    model = _Model(salt)
    app = ProxyApp(model, [card], ProxySettings(host="127.0.0.1", port=0))  # type: ignore[arg-type]
    eos = card.tokenizer.token_to_id(card.special_tokens["eos_token"])
    assert eos == EOS  # the made-up model's end token is the tiny tokenizer's
    streamed, out = asyncio.run(app._beam(parsed))
    assert streamed == b"" and out is not None
    params = BeamParams(2, 4, temperature=0.0)
    want = [star_beams([5, 6], params, salt), star_beams([7], params, salt)]
    assert [vllm_beams([5, 6], params, salt), vllm_beams([7], params, salt)] == want
    choices = out["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2, 3]
    for choice, (tokens, _, finish, stop) in zip(choices, want[0] + want[1], strict=True):
        assert (choice["finish_reason"], choice["stop_reason"]) == (finish, stop)
        assert choice["text"] == card.tokenizer.decode(tokens)
    generated = sum(len(t) for beams in want for t, *_ in beams)
    assert out["usage"] == {
        "prompt_tokens": 3,
        "completion_tokens": generated,
        "total_tokens": 3 + generated,
    } | {k: out["usage"][k] for k in out["usage"] if k.endswith("_details")}
    assert {r.sampling["logprobs"] for r in model.requests} == {4}
    assert all(r.sampling["max_tokens"] == 1 for r in model.requests)


@pytest.mark.parametrize("stream", [False, True])
def test_a_chat_beam_search_answers_each_beam_as_a_choice(card: Any, stream: bool) -> None:
    """use_beam_search on chat (vLLM serves it streamed too: each beam's text in one chunk
    when the search is done): the messages are the beams' texts, in the beams' order."""
    import json

    from proxy import sse
    from proxy.app import ProxyApp
    from proxy.openai import parse_chat
    from star.settings import ProxySettings
    from tests.e2e.streams import texts

    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "n": 3}
    body |= {"use_beam_search": True, "temperature": 0, "max_tokens": 5, "stream": stream}
    parsed = parse_chat(json.dumps(body).encode(), {"tiny": card})
    app = ProxyApp(_Model(7), [card], ProxySettings(host="127.0.0.1", port=0))  # type: ignore[arg-type]
    streamed, whole = asyncio.run(app._beam(parsed))
    prompt = list(parsed.gen.prompt_token_ids)
    want = star_beams(prompt, BeamParams(3, 5, temperature=0.0), 7)
    assert want == vllm_beams(prompt, BeamParams(3, 5, temperature=0.0), 7)
    shown = {i: card.tokenizer.decode(tokens) for i, (tokens, *_) in enumerate(want)}
    if not stream:
        assert whole is not None and streamed == b""
        assert {c["index"]: c["message"]["content"] for c in whole["choices"]} == shown
        assert [c["finish_reason"] for c in whole["choices"]] == [w[2] for w in want]
        return
    assert whole is None
    events = sse.SSEDecoder().feed(streamed)
    assert events[-1].data == sse.DONE_DATA
    assert texts(events) == shown
