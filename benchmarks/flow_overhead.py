"""What flow control adds to a request when nothing queues: ``ModelGate.enter`` then
``Pass.settled`` (the whole per-request cost of the gate), against the same loop without them,
alternating, in one process.

    python -m benchmarks.flow_overhead [--n 20000] [--rounds 5]

Four endpoints with room; the pool is never saturated, so every request goes at once.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

from gateway.config.flow import FlowControl
from gateway.flow.control import FlowGates
from gateway.metrics import GatewayMetrics
from gateway.routing.endpoints import EndpointState


async def one_round(n: int, with_gate: bool) -> list[float]:
    eps = [EndpointState(f"http://127.0.0.1:{9000 + i}/v1") for i in range(4)]
    gate = FlowGates(GatewayMetrics()).get("m", FlowControl(mode="fair"), lambda: eps)
    out = []
    for i in range(n):
        t0 = time.perf_counter()
        if with_gate:
            turn = await gate.enter(f"t{i % 8}", "standard", 0.0, 1000, 100, 1.0)
            turn.sent()
            turn.settled(1000, 100)
        else:
            await asyncio.sleep(0)
        out.append(time.perf_counter() - t0)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=20_000)
    ap.add_argument("--rounds", type=int, default=5)
    ns = ap.parse_args()
    for r in range(ns.rounds):
        base = asyncio.run(one_round(ns.n, False))
        gated = asyncio.run(one_round(ns.n, True))
        b, g = statistics.median(base) * 1e6, statistics.median(gated) * 1e6
        print(f"round {r}: p50 without {b:.1f} us, with the gate {g:.1f} us, added "
              f"{g - b:.1f} us; p99 added "
              f"{(sorted(gated)[int(0.99 * ns.n)] - sorted(base)[int(0.99 * ns.n)]) * 1e6:.1f}"
              " us", flush=True)


if __name__ == "__main__":
    main()
