"""Migration as a true continuation on two real CPU engines with NIXL (issue 28, docs/design.md §5.2).

The exactness matrix at the worker protocol: one request per run on the
fleet's two decode workers (fp32, the shipped tiny model), migrated after
k = 1 and 63 generated tokens by recompute (the target gets the prompt and
the generated tokens, no KV: what the proxy sends after a failed release or a
lost source) and after about 100 and 128 by a real release on the source and
a NIXL pull of its KV on the target (each on a prompt the target has never
seen, so its prefix cache cannot stand in for the pull), for some cases
there and back (released again on the target, continued on the source, whose
prefix cache then holds most of it), and after a failed pull (a real release
at about 100, but the target declines the read as expired, as when the
source's hold ran out first, and recomputes: its log must say so). The tokens and the finish reason must
equal the unmigrated run's, token for token, for greedy decoding, presence +
frequency and repetition penalties, ``min_tokens`` just before a forced EOS,
``bad_words``, ``stop_token_ids``, seeded sampling (temperature, and top-p +
top-k), structured outputs (a JSON schema, a regex, a choice) and logprobs
(each new token's and its top 3, within 1e-4). ``STAR_TEST_CONTINUATION_CASES``
(comma-separated case names) runs a subset.

Negative control: run this module with ``STAR_TEST_NO_RESUME_HOOK=1`` (the
workers' resume hook installed but doing nothing, ``workers.continuation``);
every case must then differ from its unmigrated run, and the test asserts so.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import uuid
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import pytest

from proxy.upstream import WorkerClient
from star.bus import Bus
from star.fleet import LocalCluster
from star.wire import Generate, Handoff, LogprobTokens, Release, Tokens
from tests.migration.conftest import DECODE, engine_paused
from tests.migration.test_lost import Log

pytestmark = [
    pytest.mark.engine,
    pytest.mark.timeout(1800),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
]

Logprobs = list[tuple[float, list[int], list[float]]]  # per new token: its logprob, the top k
HOOK = os.environ.get("STAR_TEST_NO_RESUME_HOOK") != "1"
MAX_TOKENS = 170
EOS = 2  # the tiny model's
RECOMPUTE_AT = (1, 63)  # fewer than kv_recompute_threshold (64) tokens: never pulled
PULL_AT = (100, 128)  # 128: a block edge of 16-token blocks (the prompt is 176 tokens)
PROMPT_LEN = 176
THERE_AND_BACK = {"greedy", "presence+frequency", "seed", "json_schema"}  # A -> B -> A


def prompt(seed: int) -> list[int]:
    """A prompt no other run of this module uses (so no prefix cache stands in for a pull)."""
    return [(seed * 131 + 7 * i * i + 3 * i) % 900 + 40 for i in range(PROMPT_LEN)]


GREEDY = {"temperature": 0.0, "ignore_eos": True}
PENALTIES = {
    "temperature": 0.0,
    "ignore_eos": True,
    "presence_penalty": 0.7,
    "frequency_penalty": 0.5,
}
CASES: dict[str, dict[str, Any]] = {
    "greedy": GREEDY,
    "presence+frequency": PENALTIES,
    "repetition": {"temperature": 0.0, "ignore_eos": True, "repetition_penalty": 1.4},
    # EOS forced (logit bias) and held back by min_tokens until token 141.
    "min_tokens": {"temperature": 0.0, "min_tokens": 140, "logit_bias": {EOS: 100.0}},
    "seed": {"temperature": 1.0, "seed": 1234, "ignore_eos": True},
    "seed+top_p+top_k": {
        "temperature": 0.8,
        "top_p": 0.9,
        "top_k": 50,
        "seed": 77,
        "ignore_eos": True,
    },
    # Completed for each prompt from a run without them (first_new_token / a_bigram).
    "stop_token_ids": {"temperature": 1.0, "seed": 99, "ignore_eos": True},
    "bad_words": GREEDY,
    # Structured outputs: the target's grammar replayed over the tokens generated before.
    # New tokens' logprobs and their 3 most likely, as well as the tokens.
    "logprobs": {**GREEDY, "logprobs": 3},
    "json_schema": {
        "temperature": 0.0,
        "structured_outputs": {
            "json": {"type": "array", "items": {"type": "integer"}, "minItems": 80}
        },
    },
    "regex": {
        "temperature": 0.0,
        "ignore_eos": True,
        "structured_outputs": {"regex": "(ab|ba|a c|q )+"},
    },
    "choice": {
        "temperature": 0.0,
        "structured_outputs": {
            "choice": ["a b c d e f g " * 40 + "yes", "a b c d e f g " * 40 + "no"]
        },
    },
}


async def sampling_for(client: WorkerClient, name: str, p: list[int]) -> dict[str, Any]:
    """Case ``name``'s sampling for prompt ``p``."""
    base = CASES[name]
    if name == "stop_token_ids":
        # A token the seeded run first emits past the last migration point.
        free, _, _ = await run(client, p, base)
        return {**base, "stop_token_ids": [first_new_token(free, 135)]}
    if name == "bad_words":
        # Two tokens the greedy run emits past 64: banned after its first from then on.
        free, _, _ = await run(client, p, base)
        return {**base, "bad_words": [a_bigram(free, 64)]}
    return base


async def run(
    client: WorkerClient,
    prompt_ids: list[int],
    sampling: dict[str, Any],
    *,
    kv: dict[str, Any] | None = None,
    generated: list[int] | None = None,
    release_at: int | None = None,
    paused: Callable[[], AbstractContextManager[object]] | None = None,
    logprobs: Logprobs | None = None,
) -> tuple[list[int], str | None, Handoff | None]:
    """One request on one worker: (new tokens, finish reason, the Handoff if it was released).

    ``generated``: a continuation after these tokens (sent as the proxy sends
    one: prompt + generated, ``continued``, ``resume``). ``release_at``:
    Release it once that many tokens came, its engine held still meanwhile.
    """
    stream = client.open()
    ids: list[int] = []
    body = {"max_tokens": MAX_TOKENS, **sampling}
    before = generated or []
    frame = Generate(
        stream.id,
        f"c-{uuid.uuid4().hex[:8]}",
        prompt_ids + before,
        body,
        kv,
        continued=len(before),
        **({"resume": True} if before else {}),
    )
    try:
        await client.send(frame)
        while True:
            try:
                msg = await asyncio.wait_for(stream.next(), 300)
            except TimeoutError:
                raise AssertionError(f"nothing from {client.address} for 300 s") from None
            if isinstance(msg, Handoff):
                return ids, None, msg
            assert isinstance(msg, Tokens), msg
            ids += msg.token_ids
            if logprobs is not None and isinstance(msg, LogprobTokens):
                k = msg.top_k
                for i, lp in enumerate(msg.logprobs):
                    top = slice(i * k, (i + 1) * k)
                    logprobs.append((lp, list(msg.top_ids[top]), list(msg.top_logprobs[top])))
            if release_at is not None and len(ids) >= release_at:
                with paused() if paused else contextlib.nullcontext():
                    await client.send(Release(stream.id, "continuation-test"))
                    await asyncio.sleep(1.0)  # the engine reads it within a step once it runs
                release_at = None
            if msg.finish_reason is not None:
                return ids, msg.finish_reason, None
    finally:
        stream.close()


def first_new_token(tokens: list[int], after: int) -> int:
    """A token that first occurs in ``tokens`` at an index past ``after``."""
    for i in range(after + 1, len(tokens)):
        if tokens[i] not in tokens[:i] and tokens[i] != EOS:
            return tokens[i]
    raise AssertionError(f"no new token after {after} in {tokens}")


def a_bigram(tokens: list[int], after: int) -> str:
    """The text of two tokens of ``tokens`` past ``after`` that the tokenizer reads back as them."""
    from tokenizers import Tokenizer

    from star.model import tiny_model_path

    tok = Tokenizer.from_file(str(tiny_model_path() / "tokenizer.json"))
    for i in range(after, len(tokens) - 1):
        text = tok.decode(tokens[i : i + 2]).strip()
        for variant in (text, " " + text):
            if (
                len(text) > 1
                and tok.encode(variant, add_special_tokens=False).ids == tokens[i : i + 2]
            ):
                return text
    raise AssertionError(f"no two-token word past {after} in {tokens}")


@pytest.fixture
async def workers(fleet: LocalCluster, bus: Bus) -> Any:
    reports = await bus.latest_reports()
    a = WorkerClient(reports[DECODE[0]].address, fleet.secret)
    b = WorkerClient(reports[DECODE[1]].address, fleet.secret)
    await a.connect(30)
    await b.connect(30)
    try:
        yield a, b
    finally:
        await a.close()
        await b.close()


async def test_the_exactness_matrix(fleet: LocalCluster, workers: Any) -> None:
    a, b = workers
    results: dict[str, dict[str, str]] = {}
    only = os.environ.get("STAR_TEST_CONTINUATION_CASES")  # a comma-separated subset
    for c, name in enumerate(CASES):
        if only and name not in only.split(","):
            continue
        try:
            results[name] = await matrix_row(fleet, a, b, c, name)
        except Exception as exc:  # one case's failure must not hide the others'
            results[name] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
        print(name, results[name], flush=True)
    report = "\n".join(f"{name}: {legs}" for name, legs in results.items())
    print(report)
    for name, legs in results.items():
        if HOOK:
            assert all(v == "exact" for v in legs.values()), f"{name}: {legs}\n{report}"
        else:  # the negative control: wrong tokens, not a crash
            assert "error" not in legs, f"{name}: {legs}\n{report}"
            assert any("differ" in v for v in legs.values()), f"{name}: {legs}\n{report}"


async def matrix_row(
    fleet: LocalCluster, a: WorkerClient, b: WorkerClient, c: int, name: str
) -> dict[str, str]:
    """Case ``name`` migrated from ``a`` to ``b`` at each point: a verdict per migration."""
    legs: dict[str, str] = {}
    # Recompute: the target gets the prompt and the tokens so far, no KV.
    p = prompt(10 * c + 1)
    sampling = await sampling_for(a, name, p)
    ref_lp: Logprobs = []
    ref, ref_finish, _ = await run(a, p, sampling, logprobs=ref_lp)
    for k in RECOMPUTE_AT:
        if k >= len(ref):
            legs[f"recompute@{k}"] = f"not run: the request ends at {len(ref)}"
            continue
        lp: Logprobs = []
        rest, finish, _ = await run(b, p, sampling, generated=ref[:k], logprobs=lp)
        legs[f"recompute@{k}"] = verdict(ref, ref_finish, ref[:k] + rest, finish, ref_lp[k:], lp)
    # Pull: a real release on the source, the target pulls P + n - 1 tokens of KV.
    for j, k in enumerate(PULL_AT):
        p = prompt(10 * c + 2 + j)
        sampling = await sampling_for(a, name, p)
        ref_lp = []
        ref, ref_finish, _ = await run(a, p, sampling, logprobs=ref_lp)
        if k + 5 >= len(ref):
            legs[f"pull@{k}"] = f"not run: the request ends at {len(ref)}"
            continue
        first, _, handoff = await run(
            a, p, sampling, release_at=k, paused=lambda: engine_paused(fleet, DECODE[0])
        )
        assert handoff is not None, (name, k, len(first))
        n = len(first)
        assert first == ref[:n], name  # the source's part is the unmigrated run's
        assert handoff.num_tokens == PROMPT_LEN + n
        lp = []
        rest, finish, _ = await run(
            b, p, sampling, kv=handoff.kv_transfer_params, generated=first, logprobs=lp
        )
        legs[f"pull@{n}"] = verdict(ref, ref_finish, first + rest, finish, ref_lp[n:], lp)
        if j == 0 and name in THERE_AND_BACK:
            # And back: released on the target 20 tokens later, continued on the source
            # (whose prefix cache holds most of it: a hit past the prompt).
            there, _, back = await run(
                b,
                p,
                sampling,
                kv=handoff.kv_transfer_params,
                generated=first,
                release_at=20,
                paused=lambda: engine_paused(fleet, DECODE[1]),
            )
            assert back is not None, (name, len(there))
            moved = first + there
            assert back.num_tokens == PROMPT_LEN + len(moved)
            rest, finish, _ = await run(a, p, sampling, kv=back.kv_transfer_params, generated=moved)
            legs[f"pull@{n}+back@{len(moved)}"] = verdict(ref, ref_finish, moved + rest, finish)
    # A failed pull: released for real, but the handoff's deadline for the
    # source's blocks is already past, so the target declines the read (vLLM
    # 0.32's pull_worker) and recomputes the prompt and the tokens so far.
    p = prompt(10 * c + 4)
    sampling = await sampling_for(a, name, p)
    ref_lp = []
    ref, ref_finish, _ = await run(a, p, sampling, logprobs=ref_lp)
    k = PULL_AT[0]
    if k + 5 >= len(ref):
        legs["failed pull"] = f"not run: the request ends at {len(ref)}"
        return legs
    first, _, handoff = await run(
        a, p, sampling, release_at=k, paused=lambda: engine_paused(fleet, DECODE[0])
    )
    assert handoff is not None, (name, k, len(first))
    n = len(first)
    expired = {**(handoff.kv_transfer_params or {}), "remote_blocks_expiry_time": 0.0}
    log = Log(fleet, DECODE[1])
    lp = []
    rest, finish, _ = await run(b, p, sampling, kv=expired, generated=first, logprobs=lp)
    if "Declining expired remote read" not in log.since():
        legs[f"failed pull@{n}"] = "the target's read did not fail (nothing declined)"
    else:
        legs[f"failed pull@{n}"] = verdict(ref, ref_finish, first + rest, finish, ref_lp[n:], lp)
    return legs


def verdict(
    ref: list[int],
    ref_finish: str | None,
    got: list[int],
    finish: str | None,
    ref_lp: Logprobs | None = None,
    lp: Logprobs | None = None,
) -> str:
    """'exact', or where and how the migrated run left the unmigrated one.

    With logprobs, also each new token's: its logprob and the top k's within
    1e-4 (a recompute's KV is one prefill's, not the decode steps', so the
    last bits may differ) and the same top ids, but for equal values
    (torch.topk orders ties arbitrarily).
    """
    if got != ref or finish != ref_finish:
        at = next((i for i, (x, y) in enumerate(zip(got, ref, strict=False)) if x != y), None)
        return f"differs at {at} (len {len(got)} vs {len(ref)}, finish {finish} vs {ref_finish})"
    if not ref_lp:
        return "exact"
    lp = lp or []
    if len(lp) != len(ref_lp):
        return f"logprobs for {len(lp)} tokens, not {len(ref_lp)}"
    for i, ((x, ids, vals), (y, ref_ids, ref_vals)) in enumerate(zip(lp, ref_lp, strict=True)):
        if len(vals) != len(ref_vals) or abs(x - y) > 1e-4:
            return f"logprobs differ at {i}: {(x, ids, vals)} vs {(y, ref_ids, ref_vals)}"
        if any(abs(u - v) > 1e-4 for u, v in zip(vals, ref_vals, strict=True)):
            return f"logprobs differ at {i}: {(x, ids, vals)} vs {(y, ref_ids, ref_vals)}"
        tied = [
            any(abs(v - w) <= 1e-6 for w in vals[:j] + vals[j + 1 :]) for j, v in enumerate(vals)
        ]
        if any(a != b and not t for a, b, t in zip(ids, ref_ids, tied, strict=True)):
            return f"top ids differ at {i}: {(x, ids, vals)} vs {(y, ref_ids, ref_vals)}"
    return "exact"
