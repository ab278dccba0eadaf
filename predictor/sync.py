"""Sharing the predictor across gateway replicas through Redis: one trains, all use.

* Leadership is a lease: ``SET {tokengate:predictor}:leader ID NX PX ttl``, renewed by its
  holder (a compare-and-renew script) every third of the ttl. Only the leader trains.
* Followers push their observations to a capped list; the leader drains it into its buffers,
  so the model learns from every replica's traffic.
* The leader publishes each new model pair with its version; everyone polls the version key
  (one ``GET`` of a small integer) and loads a newer model when it appears.

A lost Redis only pauses sharing: each replica keeps predicting with what it has.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from typing import Any, Protocol

import numpy as np
import orjson

from predictor.features import FEATURES
from predictor.models import Models
from predictor.online import OnlinePredictor

log = logging.getLogger("tokengate.predictor")
_P = "{tokengate:predictor}"
LEADER, MODEL, VERSION, SAMPLES = f"{_P}:leader", f"{_P}:model", f"{_P}:version", f"{_P}:samples"
_RENEW = ("if redis.call('GET', KEYS[1]) == ARGV[1] then "
          "return redis.call('PEXPIRE', KEYS[1], ARGV[2]) else return 0 end")


class Redis(Protocol):
    async def execute(self, *args: Any) -> Any: ...

    async def aclose(self) -> None: ...


class ModelSync:
    def __init__(self, redis: Redis, predictor: OnlinePredictor, *, lease_ms: int = 6000,
                 poll_s: float = 1.0, max_samples: int = 50_000) -> None:
        self.redis = redis
        self.predictor = predictor
        self.id = uuid.uuid4().hex
        self.lease_ms = lease_ms
        self.poll_s = poll_s
        self.max_samples = max_samples
        self.leader = False
        self._outbox: list[tuple[str, list[float], float]] = []

    def queue_sample(self, target: str, row: np.ndarray[Any, Any], log_value: float) -> None:
        """A follower's observation, shipped to the leader on the next poll."""
        if not self.leader and len(self._outbox) < self.max_samples:
            self._outbox.append((target, row.tolist(), log_value))

    async def _elect(self) -> None:
        if self.leader:
            ok = await self.redis.execute("EVAL", _RENEW, 1, LEADER, self.id, self.lease_ms)
            self.leader = bool(ok)
        if not self.leader:
            ok = await self.redis.execute("SET", LEADER, self.id, "NX", "PX", self.lease_ms)
            self.leader = ok is not None and ok != 0
            if self.leader:
                log.info("predictor: this replica trains (lease %s)", self.id[:8])

    async def publish(self, models: Models) -> None:
        if not self.leader:
            return
        await self.redis.execute("SET", MODEL, models.to_json())
        await self.redis.execute("SET", VERSION, models.version)

    async def _exchange_samples(self) -> None:
        if self.leader:
            raw = await self.redis.execute("LPOP", SAMPLES, 5000)
            by_target: dict[str, tuple[list[list[float]], list[float]]] = {}
            for item in raw or []:
                target, row, y = orjson.loads(item)
                if target in self.predictor.buffers and len(row) == len(FEATURES):
                    rows, ys = by_target.setdefault(target, ([], []))
                    rows.append(row)
                    ys.append(y)
            for target, (rows, ys) in by_target.items():
                self.predictor.add_samples(target, np.asarray(rows), np.asarray(ys))
        elif self._outbox:
            out, self._outbox = self._outbox, []
            await self.redis.execute("RPUSH", SAMPLES, *(orjson.dumps(s) for s in out))
            await self.redis.execute("LTRIM", SAMPLES, -self.max_samples, -1)

    async def _follow(self) -> None:
        raw = await self.redis.execute("GET", VERSION)
        if raw is None:
            return
        version = int(raw)
        current = self.predictor.models.version if self.predictor.models else 0
        if version > current:
            data = await self.redis.execute("GET", MODEL)
            if data is not None:
                self.predictor.adopt(await asyncio.to_thread(Models.from_json, data))

    async def step(self) -> None:
        await self._elect()
        await self._exchange_samples()
        if not self.leader:
            await self._follow()

    async def run(self) -> None:
        while True:
            try:
                await self.step()
            except (ConnectionError, OSError, TimeoutError) as exc:
                log.warning("predictor sync paused: %s", exc)
                self.leader = False
            await asyncio.sleep(self.poll_s)

    async def resign(self) -> None:
        if self.leader:
            await self.redis.execute(
                "EVAL", "if redis.call('GET', KEYS[1]) == ARGV[1] then "
                "return redis.call('DEL', KEYS[1]) else return 0 end", 1, LEADER, self.id)
            self.leader = False
