"""Fixtures for the proxy tests: a tokenizer, a model directory, a running proxy."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from tokenizers import Tokenizer

from proxy.app import ProxyApp, create_server
from proxy.http import HttpServer
from proxy.tokenizer import ModelCard
from star.settings import ProxySettings
from tests.proxy.fakes import FakeBackend, Script, build_tokenizer, write_model_dir


@pytest.fixture(scope="session")
def tokenizer() -> Tokenizer:
    return build_tokenizer()


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory, tokenizer: Tokenizer) -> Path:
    return write_model_dir(tmp_path_factory.mktemp("model") / "tiny", tokenizer)


@pytest.fixture(scope="session")
def card(model_dir: Path) -> ModelCard:
    return ModelCard.load(model_dir, name="tiny")


@dataclass
class Proxy:
    server: HttpServer
    app: ProxyApp
    backend: FakeBackend
    card: ModelCard

    @property
    def port(self) -> int:
        return self.server.port

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"


ProxyFactory = Callable[..., Awaitable[Proxy]]


@pytest.fixture
async def make_proxy(card: ModelCard, tokenizer: Tokenizer) -> AsyncIterator[ProxyFactory]:
    """Start proxies on free loopback ports; all are shut down after the test."""
    started: list[Proxy] = []

    async def make(
        script: Script | Any = None, idle_timeout_s: float = 75.0, **settings: Any
    ) -> Proxy:
        base = ProxySettings(host="127.0.0.1", port=0, drain_timeout_s=2.0)
        ps = dataclasses.replace(base, **settings)
        backend = FakeBackend(tokenizer, script)
        app = ProxyApp(backend, [card], ps)
        server = create_server(app, ps, idle_timeout_s=idle_timeout_s)
        await server.start()
        proxy = Proxy(server, app, backend, card)
        started.append(proxy)
        return proxy

    yield make
    for proxy in started:
        await proxy.server.shutdown(timeout_s=1.0)
        proxy.app.close()


@pytest.fixture
async def proxy(make_proxy: ProxyFactory) -> Proxy:
    return await make_proxy()
