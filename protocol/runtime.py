"""The event loop every program of this project runs on: uvloop where it is installed."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any


def run_loop(coro: Coroutine[Any, Any, Any]) -> Any:
    try:
        import uvloop

        uvloop.install()
    except ImportError:  # pragma: no cover - uvloop is a dependency on Linux
        pass
    return asyncio.run(coro)
