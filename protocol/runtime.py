"""The event loop every program of this project runs on: uvloop where it is installed."""

from __future__ import annotations

import asyncio
import gc
from collections.abc import Coroutine
from typing import Any


def run_loop(coro: Coroutine[Any, Any, Any]) -> Any:
    try:
        import uvloop

        uvloop.install()
    except ImportError:  # pragma: no cover - uvloop is a dependency on Linux
        pass
    return asyncio.run(coro)


def freeze_startup_heap() -> int:
    """Move every object alive after a program's startup (modules, the policy, the tokenizer,
    the app) out of the collector's reach, as vLLM does after its warm-up
    (``vllm.utils.gc_utils.freeze_gc_heap``). A full collection walks every tracked object:
    ~200,000 of them after startup, 80–120 ms on a busy two-core machine, a stall of the
    event loop each time one runs. Objects made later are collected as before. Call once the
    server listens, in a process that is the program (not in a test's thread); answers how
    many objects were frozen."""
    gc.collect()  # first, or today's garbage would never be reclaimed
    gc.freeze()
    return gc.get_freeze_count()
