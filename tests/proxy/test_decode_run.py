"""The decode run's driver (proxy.decode_run.DecodeRun) over fake workers: no vLLM, no sockets.

Each fake leg is an in-process stand-in for a stream of the token protocol:
the test pushes the frames a worker would send and reads the frames the
proxy sent. Every test checks what the client saw (each token once, in
order, or a clear error) and the events the run emitted.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import pytest

from proxy.backend import BackendError, GenerationRequest, TokenBatch
from proxy.decode_run import DecodeRun, Migrator, rejoined_frame
from proxy.upstream import ConnectionLost
from star.wire import (
    Abort,
    Attached,
    Decision,
    Error,
    Event,
    Generate,
    Handoff,
    LogprobTokens,
    Message,
    PromptLogprobs,
    Release,
    Tokens,
)

PROMPT = [11, 12]
KV = {"remote_num_tokens": 3}


class FakeLeg:
    """One stream on a fake worker."""

    def __init__(self, worker: FakeWorker, stream: int) -> None:
        self.worker = worker
        self.id = stream
        self.inbox: asyncio.Queue[Message | BaseException] = asyncio.Queue()
        self.sent: list[Message] = []
        self.closed = False

    async def next(self) -> Message:
        item = await self.inbox.get()
        if isinstance(item, BaseException):
            raise item
        return item

    async def send(self, msg: Message) -> None:
        if self.worker.dead or self.worker.breaks:
            self.worker.breaks = False
            raise ConnectionLost(f"connection to {self.worker.address} is closed")
        self.sent.append(msg)

    def close(self) -> None:
        self.closed = True

    # what the worker does
    def tokens(self, *ids: int, finish: str | None = None) -> None:
        self.inbox.put_nowait(Tokens(self.id, list(ids), finish))

    def handoff(self, num_tokens: int) -> None:
        self.inbox.put_nowait(Handoff(self.id, "m1", KV, num_tokens, [1.0, 2.0]))

    def error(self, code: str, message: str) -> None:
        self.inbox.put_nowait(Error(self.id, code, message))

    def lose(self) -> None:
        self.worker.dead = True
        self.inbox.put_nowait(ConnectionLost(f"connection to worker {self.worker.address} lost"))

    def got(self, kind: type[Message]) -> list[Message]:
        return [m for m in self.sent if isinstance(m, kind)]


class FakeWorker:
    def __init__(self, instance: str, address: str) -> None:
        self.instance = instance
        self.address = address
        self.legs: list[FakeLeg] = []
        self.dead = False  # its connection breaks
        self.refuses = False  # it refuses new connections
        self.breaks = False  # its connection breaks at the next send (it died unnoticed)


class FakeFleet:
    """The run's owner: fake workers by address, the events, what was marked down."""

    origin = "proxy:test"
    handing_off = False

    def __init__(self, *instances: str) -> None:
        self.workers = {f"h:{i}": FakeWorker(name, f"h:{i}") for i, name in enumerate(instances)}
        self.events: list[Event] = []
        self.down: list[str] = []
        self._ids = 0

    def worker(self, instance: str) -> FakeWorker:
        return next(w for w in self.workers.values() if w.instance == instance)

    def leg(self, instance: str, index: int = -1) -> FakeLeg:
        return self.worker(instance).legs[index]

    async def open_leg(self, address: str) -> FakeLeg:
        worker = self.workers[address]
        if worker.refuses:
            raise ConnectionRefusedError(f"connect to {address} refused")
        worker.dead = False
        self._ids += 1
        leg = FakeLeg(worker, self._ids)
        worker.legs.append(leg)
        return leg

    def decode_members(self) -> list[tuple[str, str]]:
        return [(w.instance, w.address) for w in self.workers.values()]

    def mark_down(self, address: str) -> None:
        self.down.append(address)

    def emit_event(self, event: Event) -> None:
        self.events.append(event)

    async def rejoin(self, instance: str, address: str, request_id: str) -> None:
        return None  # no worker here holds a request for a proxy that lost it

    def kinds(self) -> list[tuple[str, str, str]]:
        return [(e.event.value, e.detail, e.instance) for e in self.events]


class Client:
    """Consumes the run's stream as the front end does."""

    def __init__(self, run: DecodeRun) -> None:
        self.batches: list[TokenBatch] = []
        self.error: BackendError | None = None
        self.task = asyncio.create_task(self._consume(run))

    async def _consume(self, run: DecodeRun) -> None:
        try:
            async for batch in run.run():
                self.batches.append(batch)
        except BackendError as exc:
            self.error = exc

    @property
    def tokens(self) -> list[int]:
        return [t for b in self.batches for t in b.token_ids]

    @property
    def finish(self) -> str | None:
        return self.batches[-1].finish_reason if self.batches else None


async def until(cond: Callable[[], object], within_s: float = 2.0) -> None:
    deadline = time.monotonic() + within_s
    while not cond():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.001)


def decision(target: str = "d1", source: str = "d0") -> Decision:
    return Decision("m1", "r", source, target, 0, 0.0, "manual", time.time(), origin="manual")


async def started(
    fleet: FakeFleet, release_timeout_s: float = 5.0, blocker: str | None = None
) -> tuple[DecodeRun, Client]:
    req = GenerationRequest("r", "m", list(PROMPT), {"max_tokens": 100})
    run = DecodeRun(fleet, req, {"max_tokens": 100}, blocker, release_timeout_s)
    await run.start("d0", "h:0", {"from": "prefill"})
    first = continuation(fleet.leg("d0"))
    assert (first.prompt_token_ids, first.kv_transfer_params) == (PROMPT, {"from": "prefill"})
    return run, Client(run)


async def migrating(fleet: FakeFleet, run: DecodeRun, client: Client) -> None:
    """Tokens 1, 2 from d0, then a decision to d1: a Release reaches d0."""
    fleet.leg("d0").tokens(1, 2)
    await until(lambda: client.tokens == [1, 2])
    run.migrate(decision(), "h:1")
    await until(lambda: fleet.leg("d0").got(Release))


def continuation(leg: FakeLeg) -> Generate:
    [frame] = leg.got(Generate)
    assert isinstance(frame, Generate)
    return frame


async def test_a_migration_delivers_each_token_once() -> None:
    fleet = FakeFleet("d0", "d1")
    run, client = await started(fleet)
    await migrating(fleet, run, client)
    source = fleet.leg("d0")
    source.tokens(3)  # tokens go on while the source releases
    source.handoff(len(PROMPT) + 3)
    await until(lambda: fleet.worker("d1").legs)
    target = fleet.leg("d1")
    moved = continuation(target)
    assert moved.prompt_token_ids == [*PROMPT, 1, 2, 3]
    assert (moved.continued, moved.kv_transfer_params, moved.fusion) == (3, KV, [1.0, 2.0])
    # A true continuation: the request's own budget, its 3 tokens as outputs.
    assert (moved.sampling["max_tokens"], moved.resume) == (100, True)
    assert source.closed and not source.got(Abort)  # released, not aborted
    target.tokens(4)
    target.tokens(5, finish="stop")
    await client.task
    assert client.tokens == [1, 2, 3, 4, 5] and client.finish == "stop"
    assert client.error is None
    assert fleet.kinds() == [
        ("migrating", "release sent", "d0"),
        ("released", "handoff", "d0"),
        ("resumed", "", "d1"),
    ]
    assert all(e.migration == "m1" for e in fleet.events)
    assert (run.migrations, run.where, run.state.value) == (1, "d1", "done")
    assert target.closed and not target.got(Abort)


async def test_release_timeout_recomputes_on_the_target() -> None:
    fleet = FakeFleet("d0", "d1")
    run, client = await started(fleet, release_timeout_s=0.05)
    await migrating(fleet, run, client)
    await until(lambda: fleet.worker("d1").legs)  # the source never answered
    source, target = fleet.leg("d0"), fleet.leg("d1")
    assert source.closed and source.got(Abort)
    recompute = continuation(target)
    assert recompute.prompt_token_ids == [*PROMPT, 1, 2]
    assert recompute.kv_transfer_params is None
    source.handoff(len(PROMPT) + 2)  # too late: that leg is closed
    source.tokens(99)
    target.tokens(3)
    target.tokens(4, finish="length")
    await client.task
    assert client.tokens == [1, 2, 3, 4] and client.finish == "length"
    assert fleet.kinds() == [
        ("migrating", "release sent", "d0"),
        ("aborted", "src", "d0"),
        ("dispatched", "recompute", "d1"),
        ("resumed", "", "d1"),
    ]
    aborted = fleet.events[1]
    assert aborted.data == {"reason": "no handoff within the release timeout"}
    assert fleet.events[2].data == {"tokens": 2}
    assert run.recoveries == 1


async def test_source_lost_before_the_handoff_recomputes_on_the_target() -> None:
    fleet = FakeFleet("d0", "d1", "d2")
    run, client = await started(fleet)
    await migrating(fleet, run, client)
    fleet.leg("d0").lose()
    await until(lambda: fleet.worker("d1").legs)
    assert continuation(fleet.leg("d1")).prompt_token_ids == [*PROMPT, 1, 2]
    fleet.leg("d1").tokens(3, finish="stop")
    await client.task
    assert client.tokens == [1, 2, 3] and client.finish == "stop"
    assert [k[:2] for k in fleet.kinds()] == [
        ("migrating", "release sent"),
        ("aborted", "src"),
        ("dispatched", "recompute"),
        ("resumed", ""),
    ]
    assert "lost" in fleet.events[1].data["reason"]
    assert not fleet.worker("d2").legs


async def test_source_lost_after_the_handoff_does_not_touch_the_stream() -> None:
    fleet = FakeFleet("d0", "d1")
    run, client = await started(fleet)
    await migrating(fleet, run, client)
    source = fleet.leg("d0")
    source.handoff(len(PROMPT) + 2)
    await until(lambda: fleet.worker("d1").legs)
    source.lose()  # the target's NIXL read fails; it recomputes by itself
    target = fleet.leg("d1")
    target.tokens(3)
    target.tokens(4, finish="stop")
    await client.task
    assert client.tokens == [1, 2, 3, 4] and client.error is None
    assert [k[0] for k in fleet.kinds()] == ["migrating", "released", "resumed"]


async def test_a_first_leg_that_breaks_starts_on_another_instance() -> None:
    # The pick saw d0 up; it died before the Generate went out (chaos: decode kill).
    fleet = FakeFleet("d0", "d1")
    fleet.worker("d0").breaks = True
    req = GenerationRequest("r", "m", list(PROMPT), {"max_tokens": 100})
    run = DecodeRun(fleet, req, {"max_tokens": 100}, None, 5.0)
    await run.start("d0", "h:0", {"from": "prefill"})
    assert fleet.down == ["h:0"]
    restart = continuation(fleet.leg("d1"))
    assert (restart.prompt_token_ids, restart.kv_transfer_params) == (PROMPT, None)
    client = Client(run)
    fleet.leg("d1").tokens(1, finish="stop")
    await client.task
    assert client.tokens == [1] and client.error is None
    assert fleet.kinds() == [("aborted", "src", "d0"), ("dispatched", "recompute", "d1")]
    assert fleet.events[0].data["reason"] == "unreachable: connection to h:0 is closed"


async def test_a_first_leg_with_nowhere_else_to_go_is_a_clear_error() -> None:
    fleet = FakeFleet("d0")
    fleet.worker("d0").refuses = True
    req = GenerationRequest("r", "m", list(PROMPT), {"max_tokens": 100})
    run = DecodeRun(fleet, req, {"max_tokens": 100}, None, 5.0)
    with pytest.raises(BackendError, match="no live decode instance can continue request r"):
        await run.start("d0", "h:0", None)


async def test_a_lost_source_is_tried_again_when_no_other_instance_answers() -> None:
    # A worker that found this proxy silent dropped the connection: it is still up.
    fleet = FakeFleet("d0", "d1")
    _run, client = await started(fleet)
    fleet.leg("d0").tokens(1)
    await until(lambda: client.tokens == [1])
    fleet.worker("d1").refuses = True
    fleet.leg("d0").lose()
    await until(lambda: len(fleet.worker("d0").legs) == 2)
    assert continuation(fleet.leg("d0")).prompt_token_ids == [*PROMPT, 1]
    fleet.leg("d0").tokens(2, finish="stop")
    await client.task
    assert client.tokens == [1, 2] and client.error is None
    assert fleet.kinds() == [("aborted", "src", "d0"), ("dispatched", "recompute", "d0")]
    assert fleet.down == ["h:1"]


async def test_source_lost_while_decoding_continues_elsewhere() -> None:
    fleet = FakeFleet("d0", "d1")
    run, client = await started(fleet)
    fleet.leg("d0").tokens(1)
    await until(lambda: client.tokens == [1])
    fleet.leg("d0").lose()
    await until(lambda: fleet.worker("d1").legs)
    fleet.leg("d1").tokens(2, finish="stop")
    await client.task
    assert client.tokens == [1, 2]
    assert fleet.kinds() == [("aborted", "src", "d0"), ("dispatched", "recompute", "d1")]
    assert run.migrations == 0


async def test_unreachable_target_recomputes_on_the_source() -> None:
    fleet = FakeFleet("d0", "d1")
    fleet.worker("d1").refuses = True
    run, client = await started(fleet)
    await migrating(fleet, run, client)
    fleet.leg("d0").handoff(len(PROMPT) + 2)
    await until(lambda: len(fleet.worker("d0").legs) == 2)
    assert fleet.down == ["h:1"]
    assert continuation(fleet.leg("d0")).prompt_token_ids == [*PROMPT, 1, 2]
    fleet.leg("d0").tokens(3, finish="stop")
    await client.task
    assert client.tokens == [1, 2, 3] and client.finish == "stop"
    assert fleet.kinds() == [
        ("migrating", "release sent", "d0"),
        ("released", "handoff", "d0"),
        ("aborted", "dst", "d1"),
        ("dispatched", "recompute", "d0"),
        ("resumed", "", "d0"),
    ]
    assert fleet.events[2].data["reason"].startswith("target unreachable: connect to h:1 refused")


@pytest.mark.parametrize("how", ["error", "lost"])
async def test_target_lost_before_its_first_token_recomputes_on_the_source(how: str) -> None:
    fleet = FakeFleet("d0", "d1")
    run, client = await started(fleet)
    await migrating(fleet, run, client)
    fleet.leg("d0").handoff(len(PROMPT) + 2)
    await until(lambda: fleet.worker("d1").legs)
    target = fleet.leg("d1")
    if how == "error":
        target.error("engine_dead", "the engine died")
    else:
        target.lose()
    await until(lambda: len(fleet.worker("d0").legs) == 2)
    assert target.closed
    if how == "error":
        assert target.got(Abort)  # its connection is up: the request is dropped there
    fleet.leg("d0").tokens(3, finish="stop")
    await client.task
    assert client.tokens == [1, 2, 3] and client.error is None
    assert [k for k in fleet.kinds() if k[0] in ("aborted", "dispatched")] == [
        ("aborted", "dst", "d1"),
        ("dispatched", "recompute", "d0"),
    ]


async def test_nowhere_to_continue_is_a_clear_error() -> None:
    fleet = FakeFleet("d0", "d1")
    run, client = await started(fleet)
    await migrating(fleet, run, client)
    fleet.worker("d0").refuses = fleet.worker("d1").refuses = True
    fleet.leg("d0").handoff(len(PROMPT) + 2)
    await client.task
    assert client.tokens == [1, 2]
    assert client.error is not None
    assert client.error.message == "no live decode instance can continue request r"
    assert [k[:2] for k in fleet.kinds()] == [
        ("migrating", "release sent"),
        ("released", "handoff"),
        ("aborted", "dst"),
        ("aborted", "client"),  # the request ended during the migration
    ]
    assert sorted(fleet.down) == ["h:0", "h:1"]


async def test_a_client_gone_mid_release_aborts_on_the_source() -> None:
    fleet = FakeFleet("d0", "d1")
    run, client = await started(fleet)
    await migrating(fleet, run, client)
    client.task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await client.task
    source = fleet.leg("d0")
    assert source.closed and source.got(Abort)
    assert fleet.kinds()[-1] == ("aborted", "client", "")
    assert run.state.value == "done"


async def test_a_second_decision_while_releasing_is_refused() -> None:
    fleet = FakeFleet("d0", "d1", "d2")
    run, client = await started(fleet)
    await migrating(fleet, run, client)
    run.migrate(decision("d2"), "h:2")
    await until(lambda: len(fleet.events) == 2)
    assert fleet.kinds()[-1] == ("refused", "already migrating", "d0")
    assert len(fleet.leg("d0").got(Release)) == 1
    fleet.leg("d0").error("not_releasable", "finished")
    fleet.leg("d0").tokens(3, finish="stop")
    await client.task
    assert client.tokens == [1, 2, 3]
    assert fleet.kinds()[-1] == ("refused", "finished", "d0")


async def test_decisions_come_through_the_migrator_on_their_own_channel() -> None:
    fleet = FakeFleet("d0", "d1")
    run, client = await started(fleet)
    runs = {"r": run}
    migrator = Migrator(runs, {"d1": "h:1"}.get, fleet.emit_event, fleet.origin)
    assert migrator.apply(decision("d9")) == "target d9 is not a live decode instance"
    assert migrator.apply(decision("d1")) is None
    await until(lambda: fleet.leg("d0").got(Release))
    assert fleet.leg("d0").inbox.empty()  # nothing went into the wire-frame queue
    assert migrator.apply(decision("d1")) == "already migrating"
    fleet.leg("d0").tokens(1, finish="stop")
    await client.task
    assert [k[:2] for k in fleet.kinds()] == [
        ("refused", "target d9 is not a live decode instance"),
        ("migrating", "release sent"),
        ("refused", "already migrating"),
        ("refused", "finished"),
    ]


def test_a_request_another_proxy_runs_is_left_to_it() -> None:
    """With several proxies every one reads every decision: one for a request a worker
    reports running but this proxy does not run is another proxy's (no event); one that
    no worker reports is refused as unknown, and one this proxy finished as finished."""
    fleet = FakeFleet("d0", "d1")
    reported = {"r": "d0"}
    migrator = Migrator({}, {"d1": "h:1"}.get, fleet.emit_event, fleet.origin, reported.get)
    assert migrator.apply(decision("d1")) == "another proxy's request (on d0)"
    assert fleet.events == []
    reported.clear()
    assert migrator.apply(decision("d1")) == "unknown request"
    reported["r"] = "d0"  # the report still lists a request this proxy saw finish
    migrator.finished_request("r")
    assert migrator.apply(decision("d1")) == "finished"
    assert [k[:2] for k in fleet.kinds()] == [
        ("refused", "unknown request"),
        ("refused", "finished"),
    ]


async def test_an_engine_error_ends_the_stream_with_an_error() -> None:
    fleet = FakeFleet("d0")
    _, client = await started(fleet)
    fleet.leg("d0").tokens(1)
    fleet.leg("d0").tokens(2, finish="error")
    await client.task
    assert client.tokens == [1]
    assert client.error is not None and client.error.code == "engine_error"
    assert not fleet.leg("d0").got(Abort) and fleet.events == []


async def test_prompt_logprobs_from_a_leg_go_out_with_its_first_batch_once() -> None:
    # A decode instance prefilling the request itself (no prefill instance) sends
    # the prompt's logprobs before its first tokens; they ride on the first batch.
    fleet = FakeFleet("d0", "d1")
    run, client = await started(fleet)
    scores = PromptLogprobs(fleet.leg("d0").id, logprobs=[-1.0], ranks=[2])
    fleet.leg("d0").inbox.put_nowait(scores)
    await migrating(fleet, run, client)
    assert client.batches[0].prompt == scores
    source = fleet.leg("d0")
    source.handoff(len(PROMPT) + 2)
    await until(lambda: fleet.worker("d1").legs)
    target = fleet.leg("d1")
    target.tokens(3, finish="stop")
    await client.task
    assert client.tokens == [1, 2, 3] and client.error is None
    assert [b.prompt for b in client.batches[1:]] == [None]


def _attached(out: list[int], **kw: object) -> Attached:
    return Attached(stream=9, request_id="r", prompt_token_ids=[1], output_token_ids=out,
                    context=b"", **kw)  # type: ignore[arg-type]  # fmt: skip


# (the worker's answer, the tokens the run holds, the frame it gets: token ids,
# finish, logprobs and top ids; None: recover as before)
REJOIN_CASES = [
    pytest.param(_attached([5, 6, 7, 8]), [5, 6], ([7, 8], None, None, None), id="decoded on"),
    pytest.param(_attached([5, 6]), [5, 6], ([], None, None, None), id="nothing new yet"),
    pytest.param(
        _attached([5, 6, 7], finish_reason="length"), [5], ([6, 7], "length", None, None),
        id="ended meanwhile",
    ),
    pytest.param(_attached([5, 6, 7], released=True), [5], None, id="released for a move"),
    pytest.param(_attached([5, 9, 7]), [5, 6], None, id="not this run's tokens"),
    pytest.param(
        _attached([5, 6, 7, 8], logprobs=[-0.6, -0.7, -0.8], top_ids=[1, 2, 3, 4, 5, 6],
                  top_logprobs=[-1.0, -1.1, -2.0, -2.1, -3.0, -3.1], scored_from=1),
        [5, 6], ([7, 8], None, [-0.7, -0.8], [3, 4, 5, 6]),
        id="logprobs of the gap (scored after a continuation's first token)",
    ),
    pytest.param(
        _attached([5, 6, 7], logprobs=[-0.7], scored_from=2), [5], None,
        id="logprobs of a token the worker did not compute",
    ),
]  # fmt: skip


@pytest.mark.parametrize(("done", "have", "want"), REJOIN_CASES)
def test_a_rejoined_run_gets_the_tokens_after_its_own(
    done: Attached, have: list[int], want: tuple[Any, ...] | None
) -> None:
    frame = rejoined_frame(done, have, stream=3)
    if want is None:
        assert frame is None
        return
    assert frame is not None and frame.stream == 3
    ids, finish, logprobs, top = want
    assert (frame.token_ids, frame.finish_reason) == (ids, finish)
    if logprobs is None:
        assert not isinstance(frame, LogprobTokens)
    else:
        assert isinstance(frame, LogprobTokens) and frame.consistent()
        assert (frame.logprobs, frame.top_ids) == (logprobs, top)
