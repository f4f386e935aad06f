"""NIXL's side channel under CURVE (workers/nixl_auth.py), against vLLM's real listener.

vLLM's ``_nixl_handshake_listener`` runs in a thread on a loopback port with
a dummy payload; clients ask it for rank (0, 0)'s metadata as vLLM's
``_nixl_handshake`` does. No engine, no NIXL agent.
"""

from __future__ import annotations

import socket
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import msgspec
import pytest
import zmq
from structlog.testing import capture_logs

pytestmark = [
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
]

SECRET = "a" * 32 + "-cluster-secret"
OTHER_SECRET = "b" * 32 + "-cluster-secret"
PAYLOAD = b"agent metadata with UCX remote keys"
REFUSED_WAIT_MS = 1500  # a refused client's request stays unanswered this long


@pytest.fixture(scope="module")
def vllm_nixl() -> tuple[ModuleType, ModuleType, ModuleType]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # import-time deprecations in torch/vLLM
        from vllm.distributed.kv_transfer.kv_connector.v1.nixl import base_scheduler, base_worker

        import workers.nixl_auth as auth
    return base_scheduler, base_worker, auth


@dataclass
class Listener:
    path: str
    auth: ModuleType
    base_worker: ModuleType


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def listener(
    request: pytest.FixtureRequest, vllm_nixl: tuple[ModuleType, ModuleType, ModuleType]
) -> Iterator[Listener]:
    """vLLM's listener on a free port, with ``secure_nixl_side_channel(request.param)``."""
    base_scheduler, base_worker, auth = vllm_nixl
    auth.secure_nixl_side_channel(request.param)
    port = _free_port()
    ready, stop = threading.Event(), threading.Event()
    thread = threading.Thread(
        target=base_scheduler.NixlBaseConnectorScheduler._nixl_handshake_listener,
        args=({(0, 0): PAYLOAD}, ready, stop, "127.0.0.1", port),
        daemon=True,
    )
    thread.start()
    try:
        assert ready.wait(10)
        yield Listener(f"tcp://127.0.0.1:{port}", auth, base_worker)
    finally:
        stop.set()
        thread.join(10)
        auth.secure_nixl_side_channel("")
    assert not thread.is_alive()


def _ask(make: Callable[[], AbstractContextManager[zmq.Socket[Any]]], timeout_ms: int) -> Any:
    """Rank (0, 0)'s reply as ``_nixl_handshake`` asks for it, or None within ``timeout_ms``."""
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import GET_META_MSG

    with make() as sock:
        sock.setsockopt(zmq.RCVTIMEO, timeout_ms)
        sock.setsockopt(zmq.SNDTIMEO, timeout_ms)
        try:
            sock.send(msgspec.msgpack.encode((GET_META_MSG, 0, 0)))
            return sock.recv_multipart()
        except zmq.Again:
            return None


def _patched(lst: Listener) -> AbstractContextManager[zmq.Socket[Any]]:
    """A REQ socket the way vLLM's ``_nixl_handshake`` makes one (through the patched name)."""
    return lst.base_worker.zmq_ctx(zmq.REQ, lst.path)  # type: ignore[no-any-return]


def _plain(lst: Listener) -> AbstractContextManager[zmq.Socket[Any]]:
    """A REQ socket without CURVE: any peer on the network."""
    base = lst.base_worker._star_base_zmq_ctx
    return base(zmq.REQ, lst.path)  # type: ignore[no-any-return]


def _other_secret(lst: Listener) -> AbstractContextManager[zmq.Socket[Any]]:
    """A CURVE REQ socket keyed by another cluster's secret."""
    return lst.auth.curve_zmq_ctx(lst.auth.curve_keys(OTHER_SECRET), zmq.REQ, lst.path)  # type: ignore[no-any-return]


@pytest.mark.parametrize("listener", [SECRET], indirect=True)
def test_a_peer_with_the_secret_gets_the_metadata(listener: Listener) -> None:
    reply = _ask(lambda: _patched(listener), 5000)
    assert reply is not None and reply[0] == PAYLOAD
    assert isinstance(msgspec.msgpack.decode(reply[1]), float)  # the clock stamp, as before
    with _patched(listener) as sock:
        assert sock.getsockopt(zmq.MECHANISM) == zmq.CURVE


def _refused_lines(
    logs: list[dict[str, Any]], make: Callable[[], AbstractContextManager[zmq.Socket[Any]]]
) -> list[dict[str, Any]]:
    """Ask with ``make`` (never answered) until the guard logs ``nixl_peer_refused``, then
    once more; the lines logged. The guard reads its monitor asynchronously, and on a loaded
    machine a short-lived client may not get through its handshake in one try."""

    def lines() -> list[dict[str, Any]]:
        return [e for e in logs if e["event"] == "nixl_peer_refused"]

    deadline = time.monotonic() + 20
    while not lines():
        assert time.monotonic() < deadline, "no nixl_peer_refused line"
        assert _ask(make, REFUSED_WAIT_MS) is None
    assert _ask(make, REFUSED_WAIT_MS) is None  # libzmq retries too: still the one line
    time.sleep(1.0)  # two turns of the guard's loop
    return lines()


@pytest.mark.parametrize("listener", [SECRET], indirect=True)
def test_a_plain_peer_gets_nothing(listener: Listener) -> None:
    with capture_logs() as logs:
        [line] = _refused_lines(logs, lambda: _plain(listener))
    assert (line["log_level"], line["reason"], line["refused"]) == ("warning", "no_curve", 1)
    reply = _ask(lambda: _patched(listener), 5000)  # the listener still serves the cluster
    assert reply is not None and reply[0] == PAYLOAD


@pytest.mark.parametrize("listener", [SECRET], indirect=True)
def test_a_peer_with_another_secret_gets_nothing(listener: Listener) -> None:
    with capture_logs() as logs:
        [line] = _refused_lines(logs, lambda: _other_secret(listener))
    assert (line["reason"], line["peer"]) == ("wrong_key", "unknown")
    assert SECRET not in repr(logs) and OTHER_SECRET not in repr(logs)
    reply = _ask(lambda: _patched(listener), 5000)
    assert reply is not None and reply[0] == PAYLOAD


@pytest.mark.parametrize("listener", [SECRET], indirect=True)
def test_a_peer_knowing_only_the_server_key_is_refused_by_zap(listener: Listener) -> None:
    # The server's public key is the secret's, but a public key is not meant to stay secret.
    auth = listener.auth
    ours, theirs = auth.curve_keys(SECRET), auth.curve_keys(OTHER_SECRET)
    leaked = auth.CurveKeys(ours.server_public, b"", theirs.client_public, theirs.client_secret)
    with capture_logs() as logs:
        [line] = _refused_lines(logs, lambda: auth.curve_zmq_ctx(leaked, zmq.REQ, listener.path))
    # Once per peer address.
    assert (line["reason"], line["peer"]) == ("unknown_client_key", "127.0.0.1")


def test_refusals_are_logged_once_per_peer_and_once_a_minute_per_reason(
    vllm_nixl: tuple[ModuleType, ModuleType, ModuleType],
) -> None:
    refusals = vllm_nixl[2].RefusalLog(every_s=60.0)
    assert refusals.refused("no_curve", None, 100.0) == 1
    assert [refusals.refused("no_curve", None, t) for t in (101.0, 159.0)] == [0, 0]
    assert refusals.refused("no_curve", None, 160.0) == 3  # the two unlogged ones too
    assert refusals.refused("wrong_key", None, 160.5) == 1
    assert refusals.refused("unknown_client_key", "10.0.0.9", 161.0) == 1
    assert refusals.refused("unknown_client_key", "10.0.0.9", 300.0) == 0
    assert refusals.refused("unknown_client_key", "10.0.0.8", 300.0) == 2  # of this reason


@pytest.mark.parametrize("listener", [""], indirect=True)
def test_without_a_secret_the_channel_is_vllms_own(listener: Listener) -> None:
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl import utils

    assert listener.base_worker.zmq_ctx is utils.zmq_ctx
    for make in (_patched, _plain):
        reply = _ask(lambda make=make: make(listener), 5000)  # type: ignore[misc]
        assert reply is not None and reply[0] == PAYLOAD
    assert _ask(lambda: _other_secret(listener), REFUSED_WAIT_MS) is None  # CURVE vs none


def test_keys_are_the_clusters_own(vllm_nixl: tuple[ModuleType, ModuleType, ModuleType]) -> None:
    auth = vllm_nixl[2]
    keys = auth.curve_keys(SECRET)
    assert keys == auth.curve_keys(SECRET)  # every engine of the cluster derives the same
    other = auth.curve_keys(OTHER_SECRET)
    assert keys.server_public != other.server_public
    assert keys.client_public != other.client_public
    assert keys.server_public != keys.client_public
    assert zmq.curve_public(keys.server_secret) == keys.server_public
    assert "secret" not in repr(keys).replace("server_public", "").replace("client_public", "")


def test_secure_is_idempotent_and_reversible(
    vllm_nixl: tuple[ModuleType, ModuleType, ModuleType],
) -> None:
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl import utils

    base_scheduler, base_worker, auth = vllm_nixl
    try:
        auth.secure_nixl_side_channel(SECRET)
        auth.secure_nixl_side_channel(SECRET)
        for module in (base_scheduler, base_worker):
            assert module.zmq_ctx is not utils.zmq_ctx
            assert module._star_base_zmq_ctx is utils.zmq_ctx
    finally:
        auth.secure_nixl_side_channel("")
    assert base_scheduler.zmq_ctx is utils.zmq_ctx and base_worker.zmq_ctx is utils.zmq_ctx


def test_the_engine_gets_the_secret_from_the_settings() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from workers import engine_config as eng
    from star.settings import env_key

    name = env_key("cluster.secret")
    spec = eng.EngineSpec(model="m", nixl_secret=SECRET)
    assert eng.vllm_environment(spec, False, 5601, {}, 2)[name] == SECRET
    assert SECRET not in repr(spec)
    assert name not in eng.vllm_environment(eng.EngineSpec(model="m"), False, 5601, {}, 2)
