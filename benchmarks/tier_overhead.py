"""What capacity tiers add to a request when nothing queues, measured side by side: one
gateway (fair flow control on, quotas in a real Redis) in front of an echo upstream, and the
same chat request sent in turn by a tenant without a reservation (``payg``: no tier bucket),
a tenant with one (``reserved``: its tier bucket an optional charge of its quota's own
reservation, settled with it) and
the first tenant as ``flex``, one at a time.

    python -m benchmarks.tier_overhead [--requests 2000] [--rounds 3] [--lease F] [--out DIR]

Reported per round: p50 and p99 of each and the difference against ``payg``. Every request
reserves its tokens against the tenant's quota either way; the difference is the tier.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

from benchmarks.common import write
from benchmarks.proxy import echo_and_redis, interleaved, percentiles_ms, stop_all
from loadtests.client import wait_for
from protocol.loopback import free_port

KEYS = {"payg": "tier-bench-payg", "reserved": "tier-bench-reserved",
        "flex": "tier-bench-payg"}


def policy(upstream: str, lease: float) -> dict[str, Any]:
    def tenant(key: str, **kw: Any) -> dict[str, Any]:
        return {"keys": [{"sha256": hashlib.sha256(key.encode()).hexdigest()}],
                "limits": {"rpm": 1e9, "tpm": 1e12}, **kw}
    return {"version": 1, "settings": {"flow_control": {"mode": "fair"},
                                       "spend": {"log": False}, "quota_lease": lease},
            "models": {"m": {"endpoints": [{"url": upstream}],
                             "price": {"input_per_1k": 1.0, "output_per_1k": 1.0,
                                       "reserved": 0.5, "flex": 0.5}}},
            "tenants": {"plain": tenant(KEYS["payg"], max_priority="standard"),
                        "owner": tenant(KEYS["reserved"], reserved={"m": 1e12})},
            "routes": {"r": {"tenants": ["plain", "owner"], "models": ["m"]}}}


def start(workdir: Path, lease: float) -> tuple[list[subprocess.Popen[bytes]], str]:
    procs, up, rport = echo_and_redis()
    gw = free_port()
    path = workdir / "policy.yaml"
    path.write_text(yaml.safe_dump(policy(f"http://127.0.0.1:{up}/v1", lease)))
    time.sleep(0.5)
    procs.append(subprocess.Popen([sys.executable, "-m", "tokengate", "serve", "--policy",
                                   str(path), "--port", str(gw), "--log-level", "warning",
                                   "--redis", f"redis://127.0.0.1:{rport}/0"]))
    return procs, f"http://127.0.0.1:{gw}/v1"


async def one_round(base: str, n: int) -> dict[str, Any]:
    headers = {tier: {"Authorization": f"Bearer {key}", "Content-Type": "application/json",
                      **({"x-priority": "flex"} if tier == "flex" else {})}
               for tier, key in KEYS.items()}
    out = await interleaved(dict.fromkeys(KEYS, base), n, False, warmup=100, headers=headers)
    p = {tier: percentiles_ms(xs) for tier, xs in out.items()}
    return {**p, **{f"{t}_added_p50_ms": p[t]["p50_ms"] - p["payg"]["p50_ms"]
                    for t in ("reserved", "flex")},
            **{f"{t}_added_p99_ms": p[t]["p99_ms"] - p["payg"]["p99_ms"]
               for t in ("reserved", "flex")}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default="benchmarks/results/tier-overhead")
    ap.add_argument("--lease", type=float, default=0.0,
                    help="settings.quota_lease: buckets (the tier's too) leased per replica")
    ns = ap.parse_args()
    procs, base = start(Path(tempfile.mkdtemp(prefix="tokengate-tiers-")), ns.lease)
    try:
        asyncio.run(wait_for(base.removesuffix("/v1") + "/health", timeout_s=60))
        rounds = []
        for r in range(ns.rounds):
            rounds.append(asyncio.run(one_round(base, ns.requests)))
            print(json.dumps({"round": r, **rounds[-1]}), flush=True)
        write(ns.out, {"rounds": rounds, "requests": ns.requests, "lease": ns.lease})
    finally:
        stop_all(procs)


if __name__ == "__main__":
    main()
