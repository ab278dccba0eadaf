"""What a request costs the gateway when the fair queue is full: each push then finds the
waiter to shed (``FairQueue._worst``). A flooder holds most of the queue, 64 other tenants
the rest; pushes of the flooder's requests are timed.

    python -m benchmarks.flow_shed [--queued 1024] [--pushes 5000] [--rounds 3]
"""

from __future__ import annotations

import argparse
import time

from gateway.flow.fair import FairQueue
from gateway.flow.waiter import Waiter


def one_round(queued: int, pushes: int) -> float:
    """µs per push into a full queue of ``queued`` waiters."""
    q = FairQueue("fair", max_queued=queued)
    for i in range(queued):
        q.push(Waiter("flood" if i % 8 else f"t{i % 64}", "standard", float(i), 100, 10))
    t = time.perf_counter()
    for i in range(pushes):
        q.push(Waiter("flood", "standard", 1e6 + i, 100, 10))
    return (time.perf_counter() - t) / pushes * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--queued", type=int, default=1024)
    ap.add_argument("--pushes", type=int, default=5000)
    ap.add_argument("--rounds", type=int, default=3)
    ns = ap.parse_args()
    for r in range(ns.rounds):
        print(f"round {r}: {one_round(ns.queued, ns.pushes):.1f} µs a push into a full queue "
              f"of {ns.queued}")


if __name__ == "__main__":
    main()
