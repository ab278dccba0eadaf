"""Micro-benchmark: the relay's cost per SSE event (``gateway.request.relay.relay_stream``).

Feeds a stream of vLLM-shaped chat chunks (compact JSON as vLLM writes it, and spaced JSON as
Python's ``json.dumps`` writes it) through the relay into a sink that only counts bytes, and
prints microseconds per event, best and median of several repetitions. A component benchmark:
it imports the relay directly, no HTTP.

    python -m benchmarks.relay [--events 20000] [--repeats 7]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from collections.abc import AsyncIterator

from gateway.request.relay import RelayResult, relay_stream


class _Sink:
    def __init__(self) -> None:
        self.n = 0

    async def write(self, data: bytes) -> None:
        self.n += len(data)


def _events(n: int, spaced: bool) -> list[bytes]:
    sep = (", ", ": ") if spaced else (",", ":")
    out = []
    for i in range(n):
        obj = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1,
               "model": "up-model", "choices": [{"index": 0, "delta": {"content": f"t{i}"},
                                                 "logprobs": None, "finish_reason": None}]}
        out += [b"data: " + json.dumps(obj, separators=sep).encode() + b"\n", b"\n"]
    usage = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1,
             "model": "up-model", "choices": [],
             "usage": {"prompt_tokens": 10, "completion_tokens": n, "total_tokens": n + 10}}
    out += [b"data: " + json.dumps(usage, separators=sep).encode() + b"\n", b"\n",
            b"data: [DONE]\n", b"\n"]
    return out


async def _lines(lines: list[bytes]) -> AsyncIterator[bytes]:
    for line in lines:
        yield line


async def _once(lines: list[bytes], events: int) -> tuple[float, RelayResult]:
    sink = _Sink()
    t0 = time.perf_counter()
    res = await relay_stream(_lines(lines), sink,
                             upstream_model="up-model", served_model="served",
                             pass_usage=False)
    return (time.perf_counter() - t0) / events * 1e6, res


async def main_async(events: int, repeats: int) -> None:
    for spaced in (False, True):
        lines = _events(events, spaced)
        runs = []
        res = None
        for _ in range(repeats):
            us, res = await _once(lines, events)
            runs.append(us)
        assert res is not None
        print(f"{'spaced ' if spaced else 'compact'} JSON: {statistics.median(runs):.2f} µs "
              f"per event (median of {repeats}; best {min(runs):.2f}); counted "
              f"{res.chunks}/{events} tokens, usage "
              f"{'seen' if res.usage else 'missed'}; runs: "
              + ", ".join(f"{r:.2f}" for r in runs))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--events", type=int, default=20000)
    ap.add_argument("--repeats", type=int, default=7)
    a = ap.parse_args()
    asyncio.run(main_async(a.events, a.repeats))


if __name__ == "__main__":
    main()
