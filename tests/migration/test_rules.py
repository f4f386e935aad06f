"""The sans-IO parts of migration: the decode run's table, refusals, sampling carry-over."""

from __future__ import annotations

import time

import msgspec
import pytest

from proxy.migration import (
    TRANSITIONS,
    IllegalTransition,
    RunEvent,
    RunState,
    leg_frame,
    next_state,
    refusal,
)
from star.sampling import continuation, migration_blocker
from star.wire import Decision, decode, encode
from tests.reports import report


@pytest.mark.parametrize(
    ("sampling", "reason", "resubmitted"),
    [
        (
            {"max_tokens": 10, "temperature": 0.7, "top_p": 0.9, "top_k": 5, "min_p": 0.1},
            None,
            None,
        ),
        ({"logit_bias": {5: 1.0}, "allowed_token_ids": [1, 2]}, None, None),
        ({"stop_token_ids": [3], "ignore_eos": True, "min_tokens": 4}, None, None),
        ({"presence_penalty": 0.0, "repetition_penalty": 1.0}, None, None),
        # A true continuation carries the generated tokens and the seeded stream ...
        ({"presence_penalty": 0.5}, None, "presence_penalty is 0.5"),
        ({"frequency_penalty": -0.1}, None, "frequency_penalty is -0.1"),
        ({"repetition_penalty": 1.1}, None, "repetition_penalty is 1.1"),
        ({"seed": 3, "temperature": 0.8}, None, "seed is set"),
        ({"bad_words": ["x"]}, None, "bad_words is set"),
        ({"structured_outputs": {"regex": "a+"}}, None, "structured_outputs is set"),
        ({"logprobs": 0}, None, "logprobs is set"),
        # Prompt logprobs come with the first token, before a release can start,
        # and no continuation computes them again (workers.engine_config).
        ({"prompt_logprobs": 1}, None, None),
        # Where the original prompt ends the reasoning: a true continuation keeps it.
        ({"reasoning_ended": False, "reasoning_parser_kwargs": {}}, None, None),
        # ... not (yet) these.
        ({"n": 2}, "n > 1", "n > 1"),
        ({"presence_penalty": "lots"}, None, "unreadable sampling parameters"),
        ({"n": "two"}, "unreadable sampling parameters", "unreadable sampling parameters"),
        (
            {"logits_processors": ["x"]},
            "sampling parameter logits_processors is not carried across a migration",
            "sampling parameter logits_processors is not carried across a migration",
        ),
    ],
)
def test_migration_blocker(
    sampling: dict[str, object], reason: str | None, resubmitted: str | None
) -> None:
    assert migration_blocker(sampling) == reason
    assert migration_blocker(sampling, resume=False) == resubmitted


def test_seed_migrates_only_where_the_skip_ahead_matches_the_sampler() -> None:
    seeded = {"seed": 3, "temperature": 0.8, "max_tokens": 10}
    assert migration_blocker(seeded, seeded=True) is None
    assert migration_blocker(seeded, seeded=False) == (
        "seed is set (this engine's sampler cannot be skipped ahead exactly)"
    )
    assert migration_blocker({"temperature": 0.8}, seeded=False) is None


def test_continuation_reduces_the_budgets() -> None:
    base = {"max_tokens": 100, "min_tokens": 30, "temperature": 0.0}
    assert continuation(base, 40) == {"max_tokens": 60, "min_tokens": 0, "temperature": 0.0}
    assert continuation(base, 10)["min_tokens"] == 20
    assert continuation({"max_tokens": 5}, 4) == {"max_tokens": 1}
    with pytest.raises(ValueError, match="no tokens left"):
        continuation({"max_tokens": 5}, 5)


def test_a_continuation_leg_carries_every_token_sent_and_says_how_many() -> None:
    sampling = {"max_tokens": 100, "min_tokens": 30, "temperature": 0.0}
    first = leg_frame(1, "r", [5, 6], sampling, [], None)
    assert (first.prompt_token_ids, first.sampling, first.continued) == ([5, 6], sampling, 0)
    assert first.resume is msgspec.UNSET  # a first leg's frame keeps its bytes
    kv = {"do_remote_decode": True}
    moved = leg_frame(2, "r", [5, 6], sampling, [7, 8, 9], kv)
    assert moved.prompt_token_ids == [5, 6, 7, 8, 9]
    # A true continuation: the request's own sampling and budgets, the last 3 are outputs.
    assert moved.sampling == sampling and moved.resume is True
    assert (moved.continued, moved.kv_transfer_params, moved.stream) == (3, kv, 2)
    assert moved.fusion is None and first.fusion is None
    assert decode(encode(moved)) == moved
    # The source's predictor state (from its Handoff) goes on with a continuation only.
    carried = leg_frame(3, "r", [5, 6], sampling, [7, 8, 9], kv, [2.5, 400.0])
    assert carried.fusion == [2.5, 400.0]
    assert leg_frame(4, "r", [5, 6], sampling, [], None, [2.5, 400.0]).fusion is None
    with pytest.raises(ValueError, match="no tokens left"):
        leg_frame(5, "r", [5, 6], {"max_tokens": 3}, [7, 8, 9], kv)


def test_every_transition_of_the_table() -> None:
    for (state, event), after in TRANSITIONS.items():
        assert next_state(state, event) is after
    for state in RunState:
        for event in RunEvent:
            if (state, event) not in TRANSITIONS:
                with pytest.raises(IllegalTransition):
                    next_state(state, event)
    assert not any(s is RunState.DONE for s, _ in TRANSITIONS)  # DONE is final


def test_a_migration_path_through_the_table() -> None:
    path = [
        RunEvent.MIGRATE,
        RunEvent.HANDOFF,
        RunEvent.RESUMED,
        RunEvent.MIGRATE,
        RunEvent.REFUSED,
        RunEvent.MIGRATE,
        RunEvent.HANDOFF,
        RunEvent.TARGET_LOST,
        RunEvent.RECOVERED,
        RunEvent.RESUMED,
        RunEvent.FINISH,
    ]
    state = RunState.DECODING
    for event in path:
        state = next_state(state, event)
    assert state is RunState.DONE


class _Run:
    def __init__(self, state: RunState, instance: str, blocker: str | None = None) -> None:
        self.state, self.instance, self.blocker = state, instance, blocker


def _decision(source: str = "d0", target: str = "d1") -> Decision:
    return Decision(
        id="m",
        request="r",
        source=source,
        target=target,
        tick=0,
        delta_v=0.0,
        mode="manual",
        ts=time.time(),
    )


@pytest.mark.parametrize(
    ("run", "finished", "decision", "reason"),
    [
        (None, False, _decision(), "unknown request"),
        (None, True, _decision(), "finished"),
        (
            _Run(RunState.DECODING, "d0", "seed is set"),
            False,
            _decision(),
            "not migratable: seed is set",
        ),
        (_Run(RunState.RELEASING, "d0"), False, _decision(), "already migrating"),
        (_Run(RunState.RESUMING, "d1"), False, _decision(), "already migrating"),
        (_Run(RunState.DECODING, "d1"), False, _decision(), "already on the target"),
        (_Run(RunState.DECODING, "d2"), False, _decision(), "not on d0 (on d2)"),
        (_Run(RunState.DECODING, "d0"), False, _decision(), None),
        (_Run(RunState.DECODING, "d2"), False, _decision(source=""), None),
    ],
)
def test_refusal(run: _Run | None, finished: bool, decision: Decision, reason: str | None) -> None:
    assert refusal(run, decision, finished) == reason  # type: ignore[arg-type]


def test_a_target_with_lagging_reports_is_still_a_live_decode_instance() -> None:
    """The Migrator's liveness rule is dispatch's: last known unless it refused a connection."""
    from types import SimpleNamespace

    from proxy.cluster import ClusterBackend, Directory

    bus = SimpleNamespace(keys=SimpleNamespace(reports="t:reports"))
    directory = Directory(bus, staleness_s=15)  # type: ignore[arg-type]
    now = time.monotonic()
    directory._reports = {
        "decode-0": (now - 3600, report("decode-0", address="h:1")),  # reports lag
        "decode-1": (now, report("decode-1", address="h:2")),
        "prefill-0": (now, report("prefill-0", role="prefill", address="h:3")),
    }
    backend = ClusterBackend(directory, SimpleNamespace(), "current-load", "test")  # type: ignore[arg-type]
    assert [m.instance for m in directory.members("decode")] == ["decode-1"]
    assert backend.decode_address("decode-1") == "h:2"
    assert backend.decode_address("decode-0") == "h:1"
    assert backend.decode_address("prefill-0") is None
    assert backend.decode_address("decode-9") is None
    directory.mark_down("h:1")  # it refused a connection
    assert backend.decode_address("decode-0") is None
    assert (
        backend.migrator.apply(
            Decision("d1", "cmpl-x", "decode-1", "decode-0", 0, 0.0, "m", time.time())
        )
        == "unknown request"
    )


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # importing vLLM (torch.jit)
def test_a_failed_readback_is_recomputed_not_awaited_again() -> None:
    from workers.vllm_ext import readback_tried

    readback = {"do_remote_decode": True, "remote_block_ids": [[1, 2]], "remote_engine_id": "e"}
    assert not readback_tried(readback)  # the first time: pull
    assert readback_tried({**readback, "_remote_blocks_processed": True})  # again: recompute
    assert not readback_tried({"do_remote_prefill": False, "_remote_blocks_processed": True})
    assert not readback_tried(None)
