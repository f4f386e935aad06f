"""The decode run's machine (proxy.migration.RunMachine): inputs in, actions out, no IO.

Scenarios are tables of (input, the actions it must give); the hypothesis
tests drive the machine with arbitrary input sequences and check that every
run ends in DONE (or an input raises IllegalTransition), and that each token
is delivered exactly once: what the client got is what the machine counts as
generated, and every new leg continues after exactly those tokens.
"""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.backend import BackendUnavailable, TokenBatch
from proxy.migration import (
    MAX_RECOVERIES,
    Action,
    Candidates,
    CloseLeg,
    Decided,
    Deliver,
    Emit,
    Ended,
    Fail,
    IllegalTransition,
    Input,
    ListCandidates,
    Lost,
    Opened,
    OpenFailed,
    OpenLeg,
    Received,
    RunMachine,
    RunState,
    SendRelease,
    Start,
    TimedOut,
    Warn,
)
from star.wire import Decision, Error, EventKind, Handoff, Tokens

PROMPT = [11, 12]
KV0 = {"from": "prefill"}
KV1 = {"remote_num_tokens": 4}
FLEET = (("d0", "h:0"), ("d1", "h:1"), ("d2", "h:2"))


def decision(target: str = "d1", id: str = "m1") -> Decision:
    return Decision(id, "r", "d0", target, 0, 0.0, "manual", 0.0, origin="manual")


def machine(blocker: str | None = None) -> RunMachine:
    return RunMachine("r", PROMPT, {"max_tokens": 100}, blocker, release_timeout_s=5.0)


def tokens(*ids: int, finish: str | None = None, now: float = 1.0) -> Received:
    return Received(Tokens(1, list(ids), finish), now)


def handoff(n: int, now: float = 2.0, fusion: list[float] | None = None) -> Received:
    return Received(Handoff(1, "m1", KV1, n, fusion), now)


def error(code: str, message: str = "no") -> Received:
    return Received(Error(1, code, message), 1.0)


def started(m: RunMachine) -> RunMachine:
    assert m.handle(Start("d0", "h:0", KV0)) == [
        OpenLeg("d0", "h:0", "r", PROMPT, {"max_tokens": 100}, [], KV0, None)
    ]
    assert m.handle(Opened()) == []
    return m


def kinds(actions: list[Action]) -> list[Any]:
    """Each action as something short to compare: its kind, an event's kind and detail."""
    out: list[Any] = []
    for a in actions:
        if isinstance(a, Emit):
            out.append((a.kind, a.detail))
        elif isinstance(a, OpenLeg):
            out.append(("open", a.instance, a.generated, a.kv))
        elif isinstance(a, Deliver):
            out.append(("deliver", a.batch.token_ids, a.batch.finish_reason))
        elif isinstance(a, CloseLeg):
            out.append(("close", a.abort))
        elif isinstance(a, SendRelease):
            out.append(("release", a.migration))
        elif isinstance(a, Fail):
            out.append(("fail", a.error.message))
        else:
            out.append(type(a).__name__)
    return out


SCENARIOS: dict[str, list[tuple[Input, list[Any], RunState]]] = {
    "a migration": [
        (tokens(1, 2), [("deliver", [1, 2], None)], RunState.DECODING),
        (
            Decided(decision(), "h:1", 1.5),
            [(EventKind.MIGRATING, "release sent"), ("release", "m1")],
            RunState.RELEASING,
        ),
        (tokens(3), [("deliver", [3], None)], RunState.RELEASING),  # tokens go on
        (
            handoff(5),
            [(EventKind.RELEASED, "handoff"), ("close", False), ("open", "d1", [1, 2, 3], KV1)],
            RunState.RESUMING,
        ),
        (Opened(), [], RunState.RESUMING),
        (tokens(), [], RunState.RESUMING),  # an empty frame is not the first token
        (tokens(4), [(EventKind.RESUMED, ""), ("deliver", [4], None)], RunState.DECODING),
        (tokens(5, finish="stop"), [("close", False), ("deliver", [5], "stop")], RunState.DONE),
        (Ended(), [], RunState.DONE),
    ],
    "the source refuses": [
        (
            Decided(decision(), "h:1", 1.0),
            [(EventKind.MIGRATING, "release sent"), ("release", "m1")],
            RunState.RELEASING,
        ),
        (
            error("not_releasable", "not decoding"),
            [(EventKind.REFUSED, "not decoding")],
            RunState.DECODING,
        ),
        (tokens(1), [("deliver", [1], None)], RunState.DECODING),
    ],
    "the request ends before the release": [
        (
            Decided(decision(), "h:1", 1.0),
            [(EventKind.MIGRATING, "release sent"), ("release", "m1")],
            RunState.RELEASING,
        ),
        (
            tokens(1, finish="length"),
            [(EventKind.REFUSED, "finished"), ("close", False), ("deliver", [1], "length")],
            RunState.DONE,
        ),
    ],
    "a second decision while the first runs": [
        (
            Decided(decision(), "h:1", 1.0),
            [(EventKind.MIGRATING, "release sent"), ("release", "m1")],
            RunState.RELEASING,
        ),
        (
            Decided(decision("d2", "m2"), "h:2", 1.0),
            [(EventKind.REFUSED, "already migrating")],
            RunState.RELEASING,
        ),
    ],
    "the release times out (ABORTED_SRC)": [
        (tokens(1), [("deliver", [1], None)], RunState.DECODING),
        (
            Decided(decision(), "h:1", 1.0),
            [(EventKind.MIGRATING, "release sent"), ("release", "m1")],
            RunState.RELEASING,
        ),
        (
            TimedOut(),
            [(EventKind.ABORTED, "src"), ("close", True), "ListCandidates"],
            RunState.RESUMING,
        ),
        (Candidates(FLEET), [("open", "d1", [1], None)], RunState.RESUMING),  # the target first
        (Opened(), [(EventKind.DISPATCHED, "recompute")], RunState.RESUMING),
        (tokens(2), [(EventKind.RESUMED, ""), ("deliver", [2], None)], RunState.DECODING),
    ],
    "the source is lost while decoding": [
        (tokens(1), [("deliver", [1], None)], RunState.DECODING),
        (
            Lost("reset"),
            [(EventKind.ABORTED, "src"), ("close", True), "ListCandidates"],
            RunState.RESUMING,
        ),
        (Candidates(FLEET), [("open", "d1", [1], None)], RunState.RESUMING),  # d0 is excluded
        (OpenFailed("refused"), [("open", "d2", [1], None)], RunState.RESUMING),
        (Opened(), [(EventKind.DISPATCHED, "recompute")], RunState.RESUMING),
        (tokens(2), [("deliver", [2], None)], RunState.DECODING),  # no migration: no resumed
    ],
    "a lost source is the last candidate (a worker that dropped a silent proxy is up)": [
        (tokens(1), [("deliver", [1], None)], RunState.DECODING),
        (
            Lost("reset"),
            [(EventKind.ABORTED, "src"), ("close", True), "ListCandidates"],
            RunState.RESUMING,
        ),
        (Candidates(FLEET[:2]), [("open", "d1", [1], None)], RunState.RESUMING),
        (OpenFailed("refused"), [("open", "d0", [1], None)], RunState.RESUMING),
        (Opened(), [(EventKind.DISPATCHED, "recompute")], RunState.RESUMING),
        (tokens(2), [("deliver", [2], None)], RunState.DECODING),
    ],
    "a lost source that refuses too: nowhere to continue": [
        (
            Lost("reset"),
            [(EventKind.ABORTED, "src"), ("close", True), "ListCandidates"],
            RunState.RESUMING,
        ),
        (Candidates(FLEET[:1]), [("open", "d0", [], None)], RunState.RESUMING),
        (
            OpenFailed("refused"),
            [("fail", "no live decode instance can continue request r")],
            RunState.RESUMING,
        ),
    ],
    "a release timeout never goes back to the source": [
        (
            Decided(decision(), "h:1", 1.0),
            [(EventKind.MIGRATING, "release sent"), ("release", "m1")],
            RunState.RELEASING,
        ),
        (
            TimedOut(),
            [(EventKind.ABORTED, "src"), ("close", True), "ListCandidates"],
            RunState.RESUMING,
        ),
        (Candidates(FLEET[:2]), [("open", "d1", [], None)], RunState.RESUMING),
        (
            OpenFailed("refused"),
            [("fail", "no live decode instance can continue request r")],
            RunState.RESUMING,
        ),
    ],
    "the target is unreachable (ABORTED_DST)": [
        (
            Decided(decision(), "h:1", 1.0),
            [(EventKind.MIGRATING, "release sent"), ("release", "m1")],
            RunState.RELEASING,
        ),
        (
            handoff(2),
            [(EventKind.RELEASED, "handoff"), ("close", False), ("open", "d1", [], KV1)],
            RunState.RESUMING,
        ),
        (OpenFailed("refused"), [(EventKind.ABORTED, "dst"), "ListCandidates"], RunState.RESUMING),
        (Candidates(FLEET), [("open", "d0", [], None)], RunState.RESUMING),  # the source first
        (Opened(), [(EventKind.DISPATCHED, "recompute")], RunState.RESUMING),
    ],
    "the target fails before its first token": [
        (
            Decided(decision(), "h:1", 1.0),
            [(EventKind.MIGRATING, "release sent"), ("release", "m1")],
            RunState.RELEASING,
        ),
        (
            handoff(2),
            [(EventKind.RELEASED, "handoff"), ("close", False), ("open", "d1", [], KV1)],
            RunState.RESUMING,
        ),
        (Opened(), [], RunState.RESUMING),
        (
            error("engine_dead"),
            [(EventKind.ABORTED, "dst"), ("close", True), "ListCandidates"],
            RunState.RESUMING,
        ),
        (Candidates(()), [("open", "d0", [], None)], RunState.RESUMING),
        (
            OpenFailed("refused"),
            [("fail", "no live decode instance can continue request r")],
            RunState.RESUMING,
        ),
        (Ended(), [(EventKind.ABORTED, "client")], RunState.DONE),
    ],
    "the engine ends the request with an error": [
        (
            tokens(1, finish="error"),
            [
                ("close", False),
                ("fail", "decode instance d0 ended the request with finish reason 'error'"),
            ],
            RunState.DONE,
        ),
        (Ended(), [], RunState.DONE),
    ],
    "the source fails the request": [
        (error("engine_dead", "gone"), [("fail", "d0: gone")], RunState.DECODING),
        (Ended(), [("close", True)], RunState.DONE),
    ],
    "the client goes away during a release": [
        (
            Decided(decision(), "h:1", 1.0),
            [(EventKind.MIGRATING, "release sent"), ("release", "m1")],
            RunState.RELEASING,
        ),
        (Ended(), [("close", True), (EventKind.ABORTED, "client")], RunState.DONE),
    ],
}


@pytest.mark.parametrize("name", SCENARIOS)
def test_scenario(name: str) -> None:
    m = started(machine())
    for i, (event, expected, state) in enumerate(SCENARIOS[name]):
        assert kinds(m.handle(event)) == expected, f"step {i}: {event}"
        assert m.state is state, f"step {i}: {event}"


def test_events_carry_the_migration_and_the_timings() -> None:
    m = started(machine())
    m.handle(tokens(1, 2, now=1.0))
    [migrating, _] = m.handle(Decided(decision(), "h:1", 1.5))
    assert isinstance(migrating, Emit)
    assert (migrating.instance, migrating.migration) == ("d0", "m1")
    assert migrating.data == {"target": "d1", "origin": "manual", "reason": "balance"}
    assert m.deadline() == 6.5
    [warn, released, *_] = m.handle(handoff(3, now=1.75, fusion=[1.0, 2.0]))  # 4 seen
    assert isinstance(warn, Warn) and warn.data == {"handoff": 3, "seen": 4}
    assert isinstance(released, Emit) and released.instance == "d0"
    assert released.data == {
        "target": "d1",
        "tokens": 3,
        "kv_tokens": 4,
        "release_ms": 250.0,
        "predictor_state": True,
    }
    assert m.deadline() is None
    m.handle(Opened())
    [resumed, _] = m.handle(tokens(3, now=2.0))
    assert isinstance(resumed, Emit) and resumed.instance == "d1"
    assert resumed.data == {"source": "d0", "stall_ms": 1000.0, "pull_ms": 250.0}
    assert (m.migrations, m.where, m.generated) == (1, "d1", [1, 2, 3])
    # A later leg carries the handed-over predictor state.
    m.handle(Lost("gone"))
    [opened] = m.handle(Candidates(FLEET))
    assert isinstance(opened, OpenLeg) and opened.fusion == [1.0, 2.0]
    assert opened.frame(7).prompt_token_ids == [*PROMPT, 1, 2, 3]


def test_every_refusal_of_a_decision_is_the_machines() -> None:
    """Asked when a decision arrives (refuses) and again when the run takes it up (Decided)."""
    m = started(machine())
    assert m.refuses(decision(), "h:1") is None
    [dead] = m.handle(Decided(decision("d9", "m9"), None, 1.0))  # the target is not live
    assert isinstance(dead, Emit) and m.state is RunState.DECODING
    assert (dead.kind, dead.detail, dead.instance, dead.migration, dead.data) == (
        EventKind.REFUSED,
        "target d9 is not a live decode instance",
        "d0",
        "m9",
        {"target": "d9"},
    )
    m.handle(Decided(decision(), "h:1", 1.0))
    [second] = m.handle(Decided(decision("d2", "m2"), "h:2", 1.0))
    # The refused decision's id, which star migrate --wait follows, not the running one's.
    assert isinstance(second, Emit) and (second.detail, second.migration) == (
        "already migrating",
        "m2",
    )
    refused = m.refuses(decision("d2", "m2"), "h:2")
    assert refused is not None and refused.detail == "already migrating"


def test_recoveries_are_bounded_and_need_a_migratable_request() -> None:
    m = started(machine())
    for _ in range(MAX_RECOVERIES):
        m.handle(Lost("gone"))
        m.handle(Candidates(FLEET))
        m.handle(Opened())
    assert kinds(m.handle(Lost("gone")))[-1] == (
        "fail",
        "request r lost its decode instance and cannot continue",
    )
    pinned = started(machine(blocker="seed is set"))
    assert kinds(pinned.handle(Lost("gone")))[-1] == (
        "fail",
        "request r lost its decode instance and cannot continue",
    )


def test_a_worker_error_keeps_its_class() -> None:
    m = started(machine())
    [fail] = m.handle(error("shutting_down", "bye"))
    assert isinstance(fail, Fail) and isinstance(fail.error, BackendUnavailable)


@pytest.mark.parametrize(
    ("before", "event"),
    [
        ([], Decided(decision(), "h:1", 0.0)),  # before Start
        ([Start("d0", "h:0", None)], tokens(1)),  # before the leg is open
        ([Start("d0", "h:0", None), Opened()], Opened()),  # not asked for
        ([Start("d0", "h:0", None), Opened()], Candidates(())),
        ([Start("d0", "h:0", None), Opened()], handoff(2)),  # no release
        ([Start("d0", "h:0", None), Opened()], TimedOut()),
        ([Start("d0", "h:0", None), Opened()], error("not_releasable")),
        ([Start("d0", "h:0", None), Opened(), tokens(1, finish="stop")], tokens(2)),  # DONE
        ([Start("d0", "h:0", None), Opened(), Lost("x")], tokens(2)),  # waits for Candidates
    ],
)
def test_illegal_inputs_raise(before: list[Input], event: Input) -> None:
    m = machine()
    for e in before:
        m.handle(e)
    with pytest.raises(IllegalTransition):
        m.handle(event)


# -- any input sequence ---------------------------------------------------------------


@st.composite
def inputs(draw: st.DrawFn, m: RunMachine, awaiting: type | None) -> Input:
    """An input: mostly one the driver could send now, sometimes any at all."""
    if awaiting is OpenLeg and draw(st.integers(0, 9)):
        answers: list[Input] = [Opened(), OpenFailed("refused")]
        return draw(st.sampled_from(answers))
    if awaiting is ListCandidates and draw(st.integers(0, 9)):
        return Candidates(tuple(draw(st.lists(st.sampled_from(FLEET), max_size=3))))
    ids = draw(st.lists(st.integers(0, 50), max_size=3))
    frames: list[Input] = [
        tokens(*ids),
        tokens(*ids),
        tokens(*ids, finish=draw(st.sampled_from(["stop", "length", "abort", "error"]))),
        Decided(decision(draw(st.sampled_from(["d0", "d1", "d2"]))), "h:9", 0.0),
        error(draw(st.sampled_from(["engine_dead", "bad_request"]))),
        Lost("reset"),
    ]
    if m.state is RunState.RELEASING:
        frames += [handoff(len(PROMPT) + len(m.generated)), error("not_releasable"), TimedOut()]
    anything: list[Input] = [*frames, Ended(), Opened(), Candidates(FLEET), TimedOut()]
    anything.append(handoff(len(PROMPT) + len(m.generated)))
    return draw(st.sampled_from(frames if draw(st.integers(0, 9)) else anything))


@settings(max_examples=400, deadline=None)
@given(st.data())
def test_every_run_ends_done_and_delivers_each_token_once(data: st.DataObject) -> None:
    m = started(machine())
    delivered: list[int] = []
    awaiting: type | None = None
    finished = failed = False
    for _ in range(40):
        event = data.draw(inputs(m, awaiting))
        try:
            actions = m.handle(event)
        except IllegalTransition:
            return  # the driver never sends it; the machine says so
        if isinstance(event, Ended):
            assert m.state is RunState.DONE
            break
        assert not finished and not failed  # nothing is accepted after the end
        awaiting = None
        for a in actions:
            assert not failed, "a failure is the last action"
            if isinstance(a, Deliver):
                assert isinstance(event, Received) and isinstance(event.msg, Tokens)
                assert a.batch.token_ids == event.msg.token_ids
                delivered += a.batch.token_ids
                finished = a.batch.finish_reason is not None
            elif isinstance(a, OpenLeg):
                # A new leg continues after exactly the tokens the client has.
                assert a.generated == delivered
                assert a.frame(1).prompt_token_ids == PROMPT + delivered
                awaiting = OpenLeg
            elif isinstance(a, ListCandidates):
                awaiting = ListCandidates
            elif isinstance(a, Fail):
                failed = True
        if not failed:  # (the tokens of a frame that fails the request count, unsent)
            assert m.generated == delivered
        if finished:
            assert m.state is RunState.DONE
        if failed:
            break
    m.handle(Ended())  # the driver always ends the run
    assert m.state is RunState.DONE
    assert m.generated[: len(delivered)] == delivered
    assert m.handle(Ended()) == []


def test_batches_are_plain_token_batches() -> None:
    m = started(machine())
    [deliver] = m.handle(tokens(1, finish="stop"))[1:]
    assert isinstance(deliver, Deliver)
    assert deliver.batch == TokenBatch([1], "stop", None)
