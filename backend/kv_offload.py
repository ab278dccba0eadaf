"""The engine's side of its lower KV tiers (``backend.kv_tiers``): host memory it owns, and
the shared pool it reaches over HTTP (``tokengate kvpool``).

* ``on_computed``: the GPU prefix cache's new blocks are stored in host memory (its events,
  ``medium`` CPU, go out with the GPU's) and queued for the pool, which a background task
  puts in batches;
* ``admit``: a new request's prompt is looked up in the pool once, on arrival, so the
  scheduler's synchronous walk knows how far the pool's prefix reaches;
* ``load``: a planned load takes the pool's blocks (a real fetch: the pool may have evicted
  some since the lookup) and waits the modelled transfer time, scaled as every step is.

The pool is a cache: when it cannot be reached the instance computes what it would have
fetched, says so once in its log, and keeps serving. It connects only to ``--kv-pool``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Sequence
from typing import Any

import aiohttp

from backend.block_pool import KVEvent
from backend.kv_tiers import CPU, POOL, HostTier, LoadCost, TierHit, TierStats, computed_blocks
from backend.request import Request

log = logging.getLogger("tokengate.backend.kv_tiers")
_TIMEOUT = aiohttp.ClientTimeout(total=5.0)
_LOOKUP_TIMEOUT = aiohttp.ClientTimeout(total=0.5)  # on a request's path: short
PUT_BATCH = 4096  # blocks per put
BACKOFF_S = 1.0  # after a failure the pool is not asked for this long


class KVTiers:
    def __init__(self, cost: LoadCost, block_size: int, *, host: HostTier | None,
                 pool_url: str | None, pool_token: str | None = None,
                 time_scale: float = 1.0,
                 session: Callable[[], aiohttp.ClientSession | None] = lambda: None) -> None:
        self.cost = cost
        self.block_size = block_size
        self.host = host
        self.pool_url = pool_url.rstrip("/") if pool_url else None
        self._auth = {"Authorization": f"Bearer {pool_token}"} if pool_token else {}
        self.time_scale = time_scale
        self.stats = {CPU: host.stats if host is not None else TierStats(), POOL: TierStats()}
        self.pool_errors = 0
        self._session = session
        self._puts: list[dict[str, Any]] = []
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._warned = False
        self._down_until = 0.0

    @property
    def bytes_per_block(self) -> int:
        return int(self.cost.kv_bytes_per_token * self.block_size)

    # -- stores ------------------------------------------------------------------------------
    def on_computed(self, events: Sequence[KVEvent]) -> list[KVEvent]:
        """The GPU pool's events of one step; returns the host tier's."""
        out = self.host.store(events) if self.host is not None else []
        if self.pool_url is not None:
            self._puts.extend({"hash": h, "parent": parent, "token_ids": list(ids), "salt": salt}
                              for h, parent, ids, salt in computed_blocks(events,
                                                                          self.block_size))
            if self._puts:
                self._wake.set()
        return out

    def start(self) -> None:
        if self.pool_url is not None and self._task is None:
            self._task = asyncio.ensure_future(self._put_loop())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def _put_loop(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._puts:
                batch, self._puts = self._puts[:PUT_BATCH], self._puts[PUT_BATCH:]
                await self._post("put", {"block_size": self.block_size,
                                         "bytes_per_block": self.bytes_per_block,
                                         "blocks": batch})

    async def _post(self, path: str, doc: dict[str, Any]) -> dict[str, Any] | None:
        session = self._session()
        loop = asyncio.get_running_loop()
        if session is None or self.pool_url is None or loop.time() < self._down_until:
            return None  # an outage costs requests one short timeout, not one each
        try:
            async with session.post(f"{self.pool_url}/v1/kv/{path}", json=doc,
                                    headers=self._auth,
                                    timeout=_TIMEOUT if path == "put" else _LOOKUP_TIMEOUT
                                    ) as r:
                if r.status != 200:
                    raise aiohttp.ClientError(f"HTTP {r.status}")
                out = await r.json()
                if not isinstance(out, dict):
                    raise aiohttp.ClientError("not a JSON object")
                self._warned = False
                return out
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            self.pool_errors += 1
            self._down_until = loop.time() + BACKOFF_S
            if not self._warned:
                log.warning("KV pool %s: %s failed (%s); computing instead until it answers",
                            self.pool_url, path, exc)
                self._warned = True
            return None

    # -- lookups and loads -----------------------------------------------------------------
    async def admit(self, req: Request, hashes: Sequence[int]) -> None:
        """How many of the prompt's leading blocks the pool holds (0 when it cannot say)."""
        if self.pool_url is None or not hashes:
            return
        out = await self._post("lookup", {"hashes": list(hashes)})
        n = out.get("matched") if out else 0
        req.pool_prefix = n if isinstance(n, int) and 0 <= n <= len(hashes) else 0

    async def load(self, req: Request, hit: TierHit) -> int:
        """Bring the planned blocks to GPU memory; returns how many arrived, in order."""
        bs = self.block_size
        if hit.pool:
            first = hit.gpu + hit.host
            out = await self._post("fetch", {"hashes": list(
                req.block_hashes[first:first + hit.pool])})
            n = out.get("fetched") if out else 0
            hit.fetched = n if isinstance(n, int) and 0 <= n <= hit.pool else 0
        host_tokens, pool_tokens = hit.host * bs, hit.fetched * bs
        seconds = self.cost.seconds(host_tokens, pool_tokens)
        if seconds > 0:
            await asyncio.sleep(seconds * self.time_scale)
        for medium, tokens in ((CPU, host_tokens), (POOL, pool_tokens)):
            self.stats[medium].count_load(tokens, tokens * self.cost.kv_bytes_per_token)
        return hit.host + hit.fetched
