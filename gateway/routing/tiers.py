"""Prefixes held below GPU memory, and what loading them costs (Mooncake's conductor, llm-d's
and Dynamo's tier-aware prefix credit).

An engine with lower KV tiers (the reference backend's ``--kv-offload-gb`` and ``--kv-pool``,
vLLM with an offloading connector) keeps blocks in host memory and may fetch any block from
a pool its peers share. For a request, ``TierIndex.lookup`` walks GPU → host → pool for one
candidate and stops at the first block no tier holds, as the engine's own lookup does; the
router then prices the candidate as

    TTFT ≈ queue + host tokens × s/token (PCIe) + [latency + pool tokens × s/token (link)]
           + uncached tokens ÷ prefill rate,

so an idle engine that can fetch a long prefix from the pool can beat a busy one holding it
on GPU. The costs per token come from the engine (``tokengate_backend_kv_tier_info``, which
the fleet's scrape reads); the pool's capacity from the pool's ``/metrics``.

*Precise* (``routing.index: precise``): what the engines' KV events say, per medium (the
precise index keeps GPU and CPU per endpoint) and the pool's own event stream, kept under
the pool's URL with medium POOL. *Approximate*: what the gateway itself routed, with the
tiers' capacities: host memory is inclusive of GPU memory (engines store every computed
block there), so its index is the approximate GPU index's blocks under the host capacity;
the pool holds every block any engine computed, up to its capacity.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Sequence
from dataclasses import dataclass

from gateway.routing.approx_index import ApproxIndex
from gateway.routing.endpoints import EngineView
from gateway.routing.prefix import PreciseIndex

CPU = "CPU"
POOL = "POOL"
_INFO = re.compile(r"^tokengate_backend_kv_tier_info\{([^}]*)\}")
_CAPACITY = re.compile(r"^tokengate_kvpool_capacity_bytes(?:\{[^}]*\})?\s+([-+0-9.eE]+)")
_LABEL = re.compile(r'(\w+)="([^"]*)"')


def read_tier_info(text: str, view: EngineView) -> None:
    """Fill ``view``'s tier fields from an engine's ``/metrics`` text (unchanged when the
    engine reports no tier: vLLM without the reference backend's gauge)."""
    host: int | None = None
    pool: float | None = None
    for line in text.splitlines():
        if not line.startswith("tokengate_backend_kv_tier_info"):
            continue
        m = _INFO.match(line)
        if m is None:
            continue
        labels = dict(_LABEL.findall(m.group(1)))
        with contextlib.suppress(ValueError, KeyError):
            spt = float(labels["seconds_per_token"])
            view.block_bytes = int(labels.get("block_bytes", "0") or 0)
            if labels.get("medium") == CPU:
                host = int(labels["capacity_blocks"])
                view.host_s_per_token = spt
            elif labels.get("medium") == POOL:
                pool = spt
                view.pool_latency_s = float(labels.get("latency_seconds", "0"))
    view.host_blocks = host
    view.pool_s_per_token = pool


def read_pool_capacity(text: str) -> float | None:
    for line in text.splitlines():
        m = _CAPACITY.match(line)
        if m is not None:
            with contextlib.suppress(ValueError):
                return float(m.group(1))
    return None


@dataclass(slots=True)
class TierMatch:
    host: int = 0  # blocks past the GPU hit found in host memory
    pool: int = 0  # then in the pool

    def load_ms(self, view: EngineView, block_size: int) -> float:
        s = self.host * block_size * view.host_s_per_token
        if self.pool and view.pool_s_per_token is not None:
            s += view.pool_latency_s + self.pool * block_size * view.pool_s_per_token
        return s * 1000.0


class TierIndex:
    """Host-memory and pool prefixes for the router, in either index mode."""

    def __init__(self) -> None:
        self.approx_host = ApproxIndex()
        self.approx_pool = ApproxIndex()

    def set_host_capacity(self, endpoint: str, blocks: int) -> None:
        self.approx_host.set_capacity(endpoint, blocks)

    def set_pool_capacity(self, pool: str, blocks: int) -> None:
        self.approx_pool.set_capacity(pool, blocks)

    def lookup(self, endpoint: str, view: EngineView, hashes: Sequence[int], gpu: int,
               max_blocks: int, pool: str | None, precise: PreciseIndex | None) -> TierMatch:
        """``precise``: the precise index to read (None: the approximate indexes)."""
        end = min(max_blocks, len(hashes))
        i = gpu
        if view.host_blocks and i < end:
            if precise is not None:
                i = precise.walk(endpoint, CPU, hashes, i, end)
            else:
                i = self.approx_host.walk(endpoint, hashes, i, end)
        host = i - gpu
        if pool is not None and view.pool_s_per_token is not None and i < end:
            if precise is not None:
                i = precise.walk(pool, POOL, hashes, i, end)
            else:
                i = self.approx_pool.walk(pool, hashes, i, end)
        return TierMatch(host, i - gpu - host)

    def record(self, endpoint: str, view: EngineView, hashes: Sequence[int],
               pool: str | None) -> None:
        """Approximate mode: the request was sent there; what it computes is stored below."""
        if view.host_blocks:
            self.approx_host.record(endpoint, hashes)
        if pool is not None and view.pool_s_per_token is not None:
            self.approx_pool.record(pool, hashes)

    def forget(self, endpoint: str) -> None:
        self.approx_host.forget(endpoint)

