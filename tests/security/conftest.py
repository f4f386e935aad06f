"""A TLS-only redis-server with an ACL user, and certificates made for it."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.security.certs import Pki, make_pki
from tests.security.tls_redis import TlsRedisServer, redis_has_tls


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def tls_redis(tmp_path_factory: pytest.TempPathFactory, pki: Pki) -> Iterator[TlsRedisServer]:
    if not redis_has_tls():
        pytest.skip("redis-server was built without TLS")
    server = TlsRedisServer(tmp_path_factory.mktemp("tls-redis"), pki)
    server.start()
    yield server
    server.stop()
