"""Ports held for a server that binds them later (star.ports.reserve)."""

from __future__ import annotations

import socket

import pytest
import zmq

from star import ports


def test_a_reserved_port_is_skipped_by_every_other_pick(monkeypatch: pytest.MonkeyPatch) -> None:
    with ports.reserve() as held:
        port = held.getsockname()[1]
        # Every other pick draws the held port first: it must go past it.
        monkeypatch.setattr(
            ports.random, "sample", lambda _range, k: [port, *range(20000, 20000 + k)]
        )
        assert ports.free_port() != port
        with ports.listen("127.0.0.1") as other:
            assert other.getsockname()[1] != port


def test_the_server_it_is_held_for_binds_it_as_zmq_does() -> None:
    """vLLM's NIXL side channel: a ZMQ ROUTER bound to the port while it is held."""
    with ports.reserve() as held:
        port = held.getsockname()[1]
        ctx = zmq.Context()
        try:
            router = ctx.socket(zmq.ROUTER)
            router.linger = 0
            router.bind(f"tcp://127.0.0.1:{port}")  # raises EADDRINUSE if it cannot
            with socket.create_connection(("127.0.0.1", port), timeout=2):
                pass  # the ROUTER, not the held socket, accepts
            router.close()
        finally:
            ctx.term()


def test_released_it_is_an_ordinary_free_port_again() -> None:
    with ports.reserve() as held:
        port = held.getsockname()[1]
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", port))
