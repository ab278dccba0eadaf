"""Run a server coroutine on its own event loop in a daemon thread (tests' loopback servers)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any

Serve = Callable[[asyncio.Event, asyncio.Event], Coroutine[Any, Any, None]]


@dataclass
class ServerThread:
    thread: threading.Thread
    loop: asyncio.AbstractEventLoop
    stop: asyncio.Event

    def close(self) -> None:
        """Stop the server and wait for its thread (again: nothing more to do)."""
        if not self.loop.is_closed():
            self.loop.call_soon_threadsafe(self.stop.set)
        self.thread.join(30)


def start_server_thread(serve: Serve, what: str) -> ServerThread:
    """``serve(ready, stop)`` must set ``ready`` once listening and return after ``stop``."""
    started = threading.Event()
    holder: dict[str, Any] = {}

    def run() -> None:
        loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        stop, ready = asyncio.Event(), asyncio.Event()
        holder.update(loop=loop, stop=stop)

        async def main() -> None:
            task = asyncio.ensure_future(serve(ready, stop))
            listening = asyncio.ensure_future(ready.wait())
            await asyncio.wait([task, listening], return_when=asyncio.FIRST_COMPLETED)
            listening.cancel()  # still pending when serve failed before listening
            if task.done():
                await task  # serve failed (or returned) before listening: raise it first,
                # so the caller, woken by ``started``, finds the error already recorded
            started.set()
            await task

        try:
            loop.run_until_complete(main())
        except BaseException as exc:  # surfaced to the caller below
            holder["error"] = exc
            started.set()
        finally:
            loop.close()

    t = threading.Thread(target=run, daemon=True, name=what)
    t.start()
    assert started.wait(30), f"{what} did not start"
    if "error" in holder:
        raise RuntimeError(f"{what} failed to start") from holder["error"]
    return ServerThread(t, holder["loop"], holder["stop"])
