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


# KEYS[1]: a hash; ARGV[1]: whether to answer with its fields; ARGV[2]: its ttl (s); then
# field, amount pairs. One round trip, atomic, one Cluster slot (one key).
_ADD = """
for i = 3, #ARGV, 2 do
  redis.call('HINCRBYFLOAT', KEYS[1], ARGV[i], ARGV[i + 1])
end
redis.call('EXPIRE', KEYS[1], ARGV[2])
if ARGV[1] == '1' then return redis.call('HGETALL', KEYS[1]) end
return {}
"""


async def add_to_hash(redis: Executor, key: str, ttl_s: int, amounts: dict[str, float], *,
                      totals: bool = False) -> dict[str, float]:
    """Add ``amounts`` to the hash's fields (replicas' shared counters), renew its expiry, and,
    with ``totals``, answer with every field's value after the addition."""
    args = [a for f, v in amounts.items() for a in (f, repr(v))]
    raw = await redis.execute("EVAL", _ADD, "1", key, "1" if totals else "0", str(ttl_s),
                              *args)
    return {(raw[i].decode() if isinstance(raw[i], bytes) else raw[i]): float(raw[i + 1])
            for i in range(0, len(raw) - 1, 2)}


def coordination_client(url: str, *, connections: int = 2, timeout_s: float = 1.0) -> Executor:
    if url.startswith("redis+cluster://"):
        return ClusterExecutor("redis://" + url[len("redis+cluster://"):], timeout_s)
    return FastRedis(url, connections=connections, timeout_s=timeout_s)
