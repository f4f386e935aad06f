"""No 503 while no prefill instance answers: the decode instance prefills the request itself.

:class:`ClusterBackend` over in-process fake workers of the token protocol
(no sockets, no engines), and the whole front end over the same fakes. A
prefill instance that is not there, refuses connections, or goes away while
it prefills leaves the request to the decode instance the dispatch policy
picks, sent without ``kv_transfer_params``; ``proxy.prefill_fallback=false``
keeps the 503, and a request the engine refuses stays a 400.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from types import SimpleNamespace
from typing import Any

import pytest
import structlog
from prometheus_client import generate_latest
from tokenizers import Tokenizer

from proxy.app import ProxyApp, create_server
from proxy.backend import BackendUnavailable, GenerationRequest, RequestRejected, TokenBatch
from proxy.cluster import ClusterBackend, Directory
from proxy.migration import RunState
from proxy.tokenizer import ModelCard
from proxy.upstream import ConnectionLost
from star.fleet import manual_decision
from star.settings import ProxySettings
from star.wire import Abort, Error, Event, EventKind, Generate, Handoff, Message, Release, Tokens
from tests.proxy.rawhttp import exchange, parse_responses, request_bytes, until
from tests.reports import report

ANSWER = "The answer is 42."
KV = {"remote_engine_id": "prefill-0", "remote_block_ids": [1, 2]}


class FakeStream:
    """One stream of a fake connection (what :class:`proxy.upstream.Stream` is)."""

    def __init__(self, client: FakeClient, stream_id: int) -> None:
        self.client = client
        self.id = stream_id
        self.inbox: asyncio.Queue[Message | BaseException] = asyncio.Queue()

    async def next(self) -> Message:
        item = await self.inbox.get()
        if isinstance(item, BaseException):
            raise item
        return item

    async def send(self, msg: Message) -> None:
        await self.client.send(msg)

    def close(self) -> None:
        self.client.streams.pop(self.id, None)


class FakeClient:
    """A connection to one fake worker: frames sent go to the worker, its answers to streams."""

    def __init__(self, worker: FakeWorker) -> None:
        self.worker = worker
        self.streams: dict[int, FakeStream] = {}
        self._ids = itertools.count(1)
        self.closed = False

    def open(self) -> FakeStream:
        stream = FakeStream(self, next(self._ids))
        self.streams[stream.id] = stream
        return stream

    async def send(self, msg: Message) -> None:
        if self.closed:
            raise ConnectionLost(f"connection to {self.worker.address} is closed")
        self.worker.received(self, msg)

    def answer(self, msg: Message) -> None:
        stream = self.streams.get(getattr(msg, "stream", -1))
        if stream is not None:
            stream.inbox.put_nowait(msg)

    def lose(self) -> None:
        """The worker went away: every open stream gets ConnectionLost."""
        self.closed = True
        for stream in list(self.streams.values()):
            stream.inbox.put_nowait(ConnectionLost(f"connection to {self.worker.address} lost"))
        self.streams.clear()


class FakeWorker:
    """A prefill or decode worker as the proxy sees it over the token protocol.

    ``mode``: ``ok``; ``down`` (refuses connections); ``dies`` (goes away on
    its first Generate, mid-prefill); ``bad_request`` (the engine refuses the
    request); ``hold`` (a decode worker that sends one token, then waits for
    a Release and hands the request off).
    """

    def __init__(self, tok: Tokenizer, instance: str, role: str, address: str, mode: str) -> None:
        self.answer_ids = tok.encode(ANSWER, add_special_tokens=False).ids
        self.instance = instance
        self.role = role
        self.address = address
        self.mode = mode
        self.generates: list[Generate] = []
        self.aborted: list[int] = []
        self.clients: list[FakeClient] = []

    def received(self, client: FakeClient, msg: Message) -> None:
        if isinstance(msg, Generate):
            self.generates.append(msg)
            asyncio.get_running_loop().call_soon(self._generate, client, msg)
        elif isinstance(msg, Abort):
            self.aborted.append(msg.stream)
        elif isinstance(msg, Release):
            ids = [t for g in self.generates if g.stream == msg.stream for t in g.prompt_token_ids]
            client.answer(Handoff(msg.stream, msg.migration, {"from": self.instance}, len(ids) + 1))

    def _generate(self, client: FakeClient, msg: Generate) -> None:
        if self.mode == "dies":
            self.mode = "down"
            client.lose()
        elif self.mode == "bad_request":
            client.answer(Error(msg.stream, "bad_request", "prompt too long for the engine"))
        elif self.role == "prefill":
            client.answer(Tokens(msg.stream, [self.answer_ids[0]], "length", None, KV))
        elif self.mode == "hold" and msg.continued == 0:
            client.answer(Tokens(msg.stream, self.answer_ids[:1]))  # then waits for a Release
        else:
            for token in self.answer_ids[msg.continued : -1]:
                client.answer(Tokens(msg.stream, [token]))
            # The answer's text, then the stop without tokens (an engine's stop token
            # would be left out of the text, as vLLM's detokenizer leaves it out).
            client.answer(Tokens(msg.stream, self.answer_ids[-1:]))
            client.answer(Tokens(msg.stream, [], "stop"))


class FakePool:
    """What :class:`proxy.upstream.WorkerPool` does, over fake workers."""

    def __init__(self, workers: list[FakeWorker]) -> None:
        self.workers = {w.address: w for w in workers}
        self.clients: dict[str, FakeClient] = {}

    async def get(self, address: str) -> FakeClient:
        worker = self.workers[address]
        if worker.mode == "down":
            raise ConnectionRefusedError(f"connect to {address} refused")
        client = self.clients.get(address)
        if client is None or client.closed:
            client = self.clients[address] = FakeClient(worker)
        return client


@dataclasses.dataclass
class Fleet:
    backend: ClusterBackend
    workers: dict[str, FakeWorker]
    events: asyncio.Queue[Event]

    def dispatched(self) -> list[Event]:
        out = []
        while not self.events.empty():
            ev = self.events.get_nowait()
            if ev.event is EventKind.DISPATCHED:
                out.append(ev)
        return out


def fleet(
    tok: Tokenizer,
    prefill: dict[str, str],
    decode: dict[str, str],
    fallback: bool = True,
    policy: str = "current-load",
) -> Fleet:
    """Fake workers named with their mode, each with a fresh report in the proxy's directory."""
    bus = SimpleNamespace(keys=SimpleNamespace(reports="t:reports"))  # only named in errors
    directory = Directory(bus, staleness_s=60)  # type: ignore[arg-type]
    workers = []
    for n, (role, members) in enumerate((("prefill", prefill), ("decode", decode))):
        for i, (name, mode) in enumerate(members.items()):
            address = f"h:{n}{i}"
            workers.append(FakeWorker(tok, name, role, address, mode))
            r = report(name, role=role, address=address, used=100 * i)
            directory._reports[name] = (time.monotonic(), r)
    events: asyncio.Queue[Event] = asyncio.Queue()
    backend = ClusterBackend(
        directory,
        FakePool(workers),  # type: ignore[arg-type]
        policy,
        "proxy:test",
        events,
        prefill_fallback=fallback,
    )
    return Fleet(backend, {w.instance: w for w in workers}, events)


def request(tok: Tokenizer, rid: str = "cmpl-1") -> GenerationRequest:
    prompt = tok.encode("hello world", add_special_tokens=False).ids
    return GenerationRequest(rid, "tiny", prompt, {"max_tokens": 64, "temperature": 0.0})


async def text(tok: Tokenizer, batches: AsyncIterator[TokenBatch]) -> tuple[str, str | None]:
    ids: list[int] = []
    finish = None
    async for batch in batches:
        ids += batch.token_ids
        finish = batch.finish_reason or finish
    return tok.decode(ids), finish


# -- the backend -------------------------------------------------------------------------


async def test_with_a_prefill_instance_the_decode_pulls_its_kv(tokenizer: Tokenizer) -> None:
    f = fleet(tokenizer, {"prefill-0": "ok"}, {"decode-0": "ok"})
    assert await text(tokenizer, f.backend.generate(request(tokenizer))) == (ANSWER, "stop")
    [leg] = f.workers["decode-0"].generates
    assert leg.kv_transfer_params == KV
    assert f.backend.prefill_fallbacks == 0
    assert [e.detail for e in f.dispatched()] == [""]


@pytest.mark.parametrize(
    "prefill",
    [
        pytest.param({}, id="none-registered"),
        pytest.param({"prefill-0": "down"}, id="refuses-connections"),
        pytest.param({"prefill-0": "dies"}, id="dies-mid-prefill"),
    ],
)
async def test_without_a_prefill_instance_the_decode_instance_prefills(
    tokenizer: Tokenizer, prefill: dict[str, str]
) -> None:
    # decode-0 holds fewer tokens: current-load (the dispatch policy) picks it.
    f = fleet(tokenizer, prefill, {"decode-0": "ok", "decode-1": "ok"})
    assert f.backend.health()["ok"] is True  # the proxy can serve: no 503 for probes either
    req = request(tokenizer)
    assert await text(tokenizer, f.backend.generate(req)) == (ANSWER, "stop")
    [leg] = f.workers["decode-0"].generates
    assert leg.kv_transfer_params is None  # the whole request: prefill and decode
    assert leg.prompt_token_ids == req.prompt_token_ids and leg.continued == 0
    assert f.workers["decode-1"].generates == []
    if prefill.get("prefill-0") == "dies":
        assert len(f.workers["prefill-0"].generates) == 1  # it got the prefill, then went away
    [ev] = f.dispatched()
    assert (ev.instance, ev.detail) == ("decode-0", "local prefill")
    assert f.backend.prefill_fallbacks == 1


async def test_the_fallback_follows_the_dispatch_policy(tokenizer: Tokenizer) -> None:
    f = fleet(tokenizer, {}, {"decode-0": "ok", "decode-1": "ok"}, policy="round-robin")
    for n in range(4):
        await text(tokenizer, f.backend.generate(request(tokenizer, f"cmpl-{n}")))
    assert [len(f.workers[d].generates) for d in ("decode-0", "decode-1")] == [2, 2]


async def test_fallback_off_is_the_503_of_before(tokenizer: Tokenizer) -> None:
    for prefill in ({}, {"prefill-0": "down"}, {"prefill-0": "dies"}):
        f = fleet(tokenizer, prefill, {"decode-0": "ok"}, fallback=False)
        assert f.backend.health()["ok"] is bool(prefill)  # a role without instances: 503
        with pytest.raises(BackendUnavailable):
            await text(tokenizer, f.backend.generate(request(tokenizer)))
        assert f.workers["decode-0"].generates == []
        assert f.backend.prefill_fallbacks == 0


async def test_a_request_the_prefill_engine_refuses_is_still_a_400(tokenizer: Tokenizer) -> None:
    f = fleet(tokenizer, {"prefill-0": "bad_request"}, {"decode-0": "ok"})
    with pytest.raises(RequestRejected) as info:
        await text(tokenizer, f.backend.generate(request(tokenizer)))
    assert info.value.status == 400 and info.value.public == "prompt too long for the engine"
    assert f.workers["decode-0"].generates == []
    assert f.backend.prefill_fallbacks == 0


async def test_one_warning_per_episode_and_a_line_when_it_ends(tokenizer: Tokenizer) -> None:
    f = fleet(tokenizer, {"prefill-0": "down"}, {"decode-0": "ok"})
    with structlog.testing.capture_logs() as logs:
        for n in range(3):
            assert (await text(tokenizer, f.backend.generate(request(tokenizer, f"a-{n}"))))[0]
        f.workers["prefill-0"].mode = "ok"  # back
        f.backend.directory._down.clear()  # as after the mark-down's few seconds
        for n in range(2):
            await text(tokenizer, f.backend.generate(request(tokenizer, f"b-{n}")))
        f.workers["prefill-0"].mode = "down"  # a second episode
        await text(tokenizer, f.backend.generate(request(tokenizer, "c-0")))
    said = [(e["event"], e.get("requests_prefilled_on_decode")) for e in logs]
    fallback = [s for s in said if s[0].startswith("prefill_")]
    assert fallback == [
        ("prefill_unavailable_decode_prefills", None),
        ("prefill_available_again", 3),
        ("prefill_unavailable_decode_prefills", None),
    ]
    assert f.backend.prefill_fallbacks == 4
    kv = [g.kv_transfer_params for g in f.workers["decode-0"].generates]
    assert kv == [None, None, None, KV, KV, None]


async def test_a_request_prefilled_on_its_decode_instance_stays_migratable(
    tokenizer: Tokenizer,
) -> None:
    f = fleet(tokenizer, {}, {"decode-0": "hold", "decode-1": "ok"})
    req = request(tokenizer)
    answer: asyncio.Task[tuple[str, str | None]] = asyncio.create_task(
        text(tokenizer, f.backend.generate(req))
    )

    def decoding() -> bool:
        run = f.backend.runs.get(req.request_id)
        return run is not None and bool(run.generated) and run.state is RunState.DECODING

    await until(decoding, 10)
    run = f.backend.runs[req.request_id]
    assert run.blocker is None
    assert f.backend.migrator.apply(manual_decision(req.request_id, "decode-0", "decode-1")) is None
    async with asyncio.timeout(10):
        assert await answer == (ANSWER, "stop")
    [first] = f.workers["decode-0"].generates
    [moved] = f.workers["decode-1"].generates
    assert first.kv_transfer_params is None
    assert moved.kv_transfer_params == {"from": "decode-0"} and moved.continued == 1
    assert moved.prompt_token_ids == req.prompt_token_ids + f.workers["decode-0"].answer_ids[:1]
    assert run.migrations == 1


# -- the front end -----------------------------------------------------------------------


Post = Callable[[dict[str, Any]], Awaitable[tuple[int, dict[str, Any], str]]]


@pytest.fixture
async def serve(card: ModelCard) -> AsyncIterator[Callable[[Fleet], Awaitable[Post]]]:
    servers = []

    async def start(f: Fleet) -> Post:
        settings = ProxySettings(host="127.0.0.1", port=0, drain_timeout_s=1.0)
        app = ProxyApp(f.backend, [card], settings)
        app.metrics.registry.register(f.backend)  # as proxy.service does
        server = create_server(app, settings)
        await server.start()
        servers.append(server)

        async def post(payload: dict[str, Any]) -> tuple[int, dict[str, Any], str]:
            raw = request_bytes("POST", "/v1/completions", payload, {"connection": "close"})
            (resp,) = parse_responses(await exchange(server.port, raw))
            metrics = generate_latest(app.metrics.registry).decode()
            return resp.status, json.loads(resp.body), metrics

        return post

    yield start
    for server in servers:
        await server.shutdown(timeout_s=1.0)


BODY = {"model": "tiny", "prompt": "hello world", "max_tokens": 64, "temperature": 0}


@pytest.mark.parametrize("prefill", [{}, {"prefill-0": "dies"}], ids=["none", "dies"])
async def test_http_200_with_the_decode_instance_prefilling(
    tokenizer: Tokenizer, serve: Callable[[Fleet], Awaitable[Post]], prefill: dict[str, str]
) -> None:
    f = fleet(tokenizer, prefill, {"decode-0": "ok"})
    post = await serve(f)
    status, body, metrics = await post(BODY)
    assert status == 200, body
    assert body["choices"][0]["text"] == ANSWER
    assert "star_proxy_prefill_fallbacks_total 1.0" in metrics


async def test_http_503_with_the_fallback_off_and_400_for_a_refused_request(
    tokenizer: Tokenizer, serve: Callable[[Fleet], Awaitable[Post]]
) -> None:
    off = await serve(fleet(tokenizer, {"prefill-0": "dies"}, {"decode-0": "ok"}, fallback=False))
    status, body, metrics = await off(BODY)
    assert status == 503 and body["error"]["type"] == "service_unavailable"
    assert "star_proxy_prefill_fallbacks_total 0.0" in metrics
    refused = await serve(fleet(tokenizer, {"prefill-0": "bad_request"}, {"decode-0": "ok"}))
    status, body, _ = await refused(BODY)
    assert status == 400 and body["error"]["message"] == "prompt too long for the engine"
