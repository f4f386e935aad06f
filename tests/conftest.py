"""Shared fixtures: a private redis-server and a Bus on it."""

from __future__ import annotations

import logging
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import structlog
from hypothesis import HealthCheck, settings

from star.bus import Bus
from star.settings import BusSettings, RedisSettings
from tests.redis_server import RedisServer

# Wall-clock checks make property tests flaky on a loaded CI machine: no per-example
# deadline and no "generation too slow" health check (tests' own settings() inherit this).
settings.register_profile("star", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("star")


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """One redis-server per test session (tests that kill it use `own_redis`)."""
    server = RedisServer(tmp_path_factory.mktemp("redis"))
    server.start()
    yield server
    server.stop()


@pytest.fixture
def own_redis(tmp_path: Path) -> Iterator[RedisServer]:
    """A redis-server of this test alone: kill and restart it at will."""
    server = RedisServer(tmp_path)
    server.start()
    yield server
    server.stop()


def redis_settings(server: RedisServer, **kw: object) -> RedisSettings:
    defaults: dict[str, object] = {
        "url": server.url,
        "connect_timeout_s": 0.5,
        "socket_timeout_s": 2.0,
        "backoff_base_s": 0.02,
        "backoff_max_s": 0.2,
        "reconnect_timeout_s": 15.0,
    }
    defaults.update(kw)
    return RedisSettings(**defaults)  # type: ignore[arg-type]


def bus_settings(**kw: object) -> BusSettings:
    defaults: dict[str, object] = {"prefix": f"t{uuid.uuid4().hex[:8]}", "block_ms": 100}
    defaults.update(kw)
    return BusSettings(**defaults)  # type: ignore[arg-type]


@pytest.fixture
async def bus(redis_server: RedisServer) -> AsyncIterator[Bus]:
    """A Bus with a fresh key prefix on the session's redis-server."""
    b = Bus.from_settings(redis_settings(redis_server), bus_settings())
    yield b
    await b.close()


@pytest.fixture
def restore_logging() -> Iterator[None]:
    """Put structlog's and the root logger's configuration back after the test (for tests
    that run a ``star`` command, which configures logging onto the stream pytest captured)."""
    saved = structlog.get_config()
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    structlog.configure(**saved)
    root.handlers[:] = handlers
    root.setLevel(level)
