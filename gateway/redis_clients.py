"""The Redis client replicas coordinate through (predictor model, prefix hints): the lean
pipelined one on a single Redis, redis-py's cluster client on Redis Cluster (it follows
MOVED/ASK to the node that owns each key). Both expose ``execute(*args)`` and ``aclose()``."""

from __future__ import annotations

from typing import Any, Protocol

from redis.asyncio.cluster import RedisCluster

from gateway.quota.limiter.redis_client import FastRedis


class Executor(Protocol):
    async def execute(self, *args: Any) -> Any: ...

    async def aclose(self) -> None: ...


class ClusterExecutor:
    def __init__(self, url: str, timeout_s: float) -> None:
        self.client = RedisCluster.from_url(url, socket_timeout=timeout_s,
                                            socket_connect_timeout=timeout_s)

    async def execute(self, *args: Any) -> Any:
        return await self.client.execute_command(*args)

    async def aclose(self) -> None:
        await self.client.aclose()


def coordination_client(url: str, *, connections: int = 2, timeout_s: float = 1.0) -> Executor:
    if url.startswith("redis+cluster://"):
        return ClusterExecutor("redis://" + url[len("redis+cluster://"):], timeout_s)
    return FastRedis(url, connections=connections, timeout_s=timeout_s)
