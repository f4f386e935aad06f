"""The token protocol's handshake as pure functions: both sides, every refusal."""

from __future__ import annotations

import dataclasses

import pytest

from star.handshake import (
    NONCE_BYTES,
    HandshakeFailed,
    ProxyHandshake,
    WorkerHandshake,
    is_loopback,
    proof,
    secret_key,
)
from star.settings import SettingsError, load_settings
from star.wire import Accept, Answer, Challenge, Hello, decode, encode

KEY = secret_key("correct horse battery staple")
OTHER = secret_key("correct horse battery stapler")


def run(worker: WorkerHandshake, proxy: ProxyHandshake) -> None:
    """One handshake with every frame through the codec, as on the wire."""
    answer = proxy.on_challenge(decode(encode(worker.challenge())))
    accept = worker.answer(decode(encode(answer)))
    proxy.on_accept(decode(encode(accept)))


def test_the_same_secret_passes_both_ways() -> None:
    run(WorkerHandshake(KEY), ProxyHandshake(KEY))


def test_the_proofs_bind_the_worker_address() -> None:
    """A proxy that dialled another address than the worker's own (a relay) is refused;
    the same address passes."""
    run(WorkerHandshake(KEY, "10.0.0.7:7100"), ProxyHandshake(KEY, "10.0.0.7:7100"))
    worker, proxy = WorkerHandshake(KEY, "10.0.0.7:7100"), ProxyHandshake(KEY, "10.0.0.9:7100")
    with pytest.raises(HandshakeFailed) as err:
        worker.answer(proxy.on_challenge(worker.challenge()))
    assert err.value.reason == "bad_proof"


def test_fresh_nonces_per_connection() -> None:
    a, b = WorkerHandshake(KEY), WorkerHandshake(KEY)
    assert len(a.nonce) == NONCE_BYTES and a.nonce != b.nonce
    assert ProxyHandshake(KEY).nonce != ProxyHandshake(KEY).nonce


def test_a_proxy_with_the_wrong_secret_is_refused() -> None:
    worker, proxy = WorkerHandshake(KEY), ProxyHandshake(OTHER)
    answer = proxy.on_challenge(worker.challenge())
    with pytest.raises(HandshakeFailed) as err:
        worker.answer(answer)
    assert err.value.reason == "bad_proof"


def test_a_worker_with_the_wrong_secret_is_refused_by_the_proxy() -> None:
    # The impostor cannot check the proxy's proof; it proves the secret it has.
    impostor, proxy = WorkerHandshake(OTHER), ProxyHandshake(KEY)
    answer = proxy.on_challenge(impostor.challenge())
    forged = Accept(proof(OTHER, b"star-token-protocol/2 worker\0", impostor.nonce, answer.nonce))
    with pytest.raises(HandshakeFailed) as err:
        proxy.on_accept(forged)
    assert err.value.reason == "bad_proof"


def test_a_replayed_answer_fails_on_a_new_connection() -> None:
    first, proxy = WorkerHandshake(KEY), ProxyHandshake(KEY)
    recorded = proxy.on_challenge(first.challenge())
    first.answer(recorded)  # accepted where it was made
    with pytest.raises(HandshakeFailed) as err:
        WorkerHandshake(KEY).answer(recorded)
    assert err.value.reason == "bad_proof"


def test_a_replayed_accept_fails_for_a_new_proxy_nonce() -> None:
    worker, proxy = WorkerHandshake(KEY), ProxyHandshake(KEY)
    recorded = worker.answer(proxy.on_challenge(worker.challenge()))
    # An impostor replays the worker's challenge and its recorded accept to a new proxy.
    fresh = ProxyHandshake(KEY)
    fresh.on_challenge(worker.challenge())
    with pytest.raises(HandshakeFailed):
        fresh.on_accept(recorded)


def test_the_workers_proof_cannot_be_reflected_as_the_proxys() -> None:
    # A man in the middle relays the proxy's nonce as a challenge to... itself:
    # the labels differ, so a worker-side proof is never a valid proxy answer.
    worker, proxy = WorkerHandshake(KEY), ProxyHandshake(KEY)
    answer = proxy.on_challenge(worker.challenge())
    accept = worker.answer(answer)
    with pytest.raises(HandshakeFailed):
        WorkerHandshake(KEY, nonce=worker.nonce).answer(Answer(accept.proof, answer.nonce))


def test_an_answer_echoing_the_challenge_nonce_is_refused() -> None:
    worker = WorkerHandshake(KEY)
    with pytest.raises(HandshakeFailed) as err:
        worker.answer(Answer(b"\0" * 32, worker.nonce))
    assert err.value.reason == "reflected_nonce"


@pytest.mark.parametrize(
    ("frame", "reason"),
    [
        (Hello("x", "decode", "m"), "unexpected_frame"),
        (Challenge(b"\1" * NONCE_BYTES), "unexpected_frame"),
        (Answer(b"", b""), "bad_nonce"),
        (Answer(b"\0" * 32, b"\2" * 7), "bad_nonce"),
        (Answer(b"", b"\2" * NONCE_BYTES), "bad_proof"),
        (Answer(b"\0" * 32, b"\2" * NONCE_BYTES), "bad_proof"),
    ],
)
def test_the_worker_refuses_anything_but_a_valid_answer(frame: object, reason: str) -> None:
    with pytest.raises(HandshakeFailed) as err:
        WorkerHandshake(KEY).answer(frame)  # type: ignore[arg-type]
    assert err.value.reason == reason


def test_the_proxy_refuses_a_worker_that_says_hello_first() -> None:
    with pytest.raises(HandshakeFailed) as err:
        ProxyHandshake(KEY).on_challenge(Hello("x", "decode", "m"))
    assert err.value.reason == "no_challenge"


@pytest.mark.parametrize("nonce", [b"", b"\1" * 8])
def test_the_proxy_refuses_a_short_challenge(nonce: bytes) -> None:
    with pytest.raises(HandshakeFailed) as err:
        ProxyHandshake(KEY).on_challenge(Challenge(nonce))
    assert err.value.reason == "bad_nonce"


def test_the_proxy_refuses_an_accept_without_a_challenge_or_a_hello_instead() -> None:
    with pytest.raises(HandshakeFailed):
        ProxyHandshake(KEY).on_accept(Accept(b"\0" * 32))
    proxy = ProxyHandshake(KEY)
    proxy.on_challenge(WorkerHandshake(KEY).challenge())
    with pytest.raises(HandshakeFailed) as err:
        proxy.on_accept(Hello("x", "decode", "m"))
    assert err.value.reason == "unexpected_frame"


@pytest.mark.parametrize(
    ("host", "loopback"),
    [
        ("127.0.0.1", True),
        ("127.1.2.3", True),
        ("::1", True),
        ("[::1]", True),
        ("localhost", True),
        ("0.0.0.0", False),
        ("::", False),
        ("10.0.0.5", False),
        ("worker-a.example", False),
    ],
)
def test_is_loopback(host: str, loopback: bool) -> None:
    assert is_loopback(host) is loopback


def test_cluster_secret_setting_is_secret_checked_and_never_echoed() -> None:
    settings = load_settings(env={"STAR_CLUSTER_SECRET": "s" * 16})
    assert settings.cluster.secret == "s" * 16
    field = next(f for f in dataclasses.fields(settings.cluster) if f.name == "secret")
    assert field.metadata["secret"]
    with pytest.raises(SettingsError) as err:
        load_settings(env={"STAR_CLUSTER_SECRET": "tooshort-xyz"})
    assert "cluster.secret" in str(err.value) and "tooshort-xyz" not in str(err.value)
    assert load_settings(env={"STAR_PROXY_PROTECT_METRICS": "true"}).proxy.protect_metrics
