"""A gateway (and its reference backends) on loopback, each in its own thread and loop."""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from gateway.reload import PolicyWatcher
from gateway.server import ServeConfig, make_state, serve
from gateway.state import GatewayState


@dataclass
class RunningGateway:
    config: ServeConfig
    state: GatewayState
    watcher: PolicyWatcher
    thread: threading.Thread
    loop: asyncio.AbstractEventLoop
    stop: asyncio.Event

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.config.port}"

    def call(self, coro: Any) -> Any:
        """Run a coroutine on the gateway's own loop (to inspect its store, say)."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(30)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.stop.set)
        self.thread.join(30)


def write_policy(path: Path, doc: dict[str, Any]) -> Path:
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def start_gateway(policy: Path, redis_url: str | None = None) -> RunningGateway:
    cfg = ServeConfig(str(policy), port=0, redis_url=redis_url, drain_timeout_s=5)
    holder: dict[str, Any] = {}
    started = threading.Event()

    def run() -> None:
        loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        stop, ready = asyncio.Event(), asyncio.Event()
        state, watcher = make_state(cfg)
        watcher.interval_s = 0.1
        holder.update(loop=loop, stop=stop, state=state, watcher=watcher)

        async def main() -> None:
            task = asyncio.ensure_future(serve(cfg, ready=ready, stop=stop,
                                               prepared=(state, watcher)))
            await asyncio.wait([task, asyncio.ensure_future(ready.wait())],
                               return_when=asyncio.FIRST_COMPLETED)
            started.set()
            await task

        try:
            loop.run_until_complete(main())
        except BaseException as exc:
            holder["error"] = exc
            started.set()
        finally:
            loop.close()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    assert started.wait(30)
    if "error" in holder:
        raise RuntimeError("gateway failed to start") from holder["error"]
    return RunningGateway(cfg, holder["state"], holder["watcher"], t, holder["loop"],
                          holder["stop"])
