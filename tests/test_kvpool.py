"""``tokengate kvpool`` over real HTTP and ZMQ: puts, lookups and fetches, its LRU in bytes,
its metrics, errors in OpenAI's shape, and its KV events (medium POOL) kept by the gateway's
precise index under the pool's URL."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import httpx
import pytest
from threaded import ServerThread, start_server_thread

from backend import kvpool
from backend.events import KVEventsConfig
from gateway.config.endpoint import KVEvents
from gateway.routing.kv_events import KVEventFollowers
from gateway.routing.prefix import PreciseIndex
from protocol.loopback import free_port

TOKEN = "a-pool-secret-of-32-characters!"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture
def pool() -> Iterator[tuple[str, KVEventsConfig, ServerThread]]:
    port = free_port()
    ev = KVEventsConfig(f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}")
    server = start_server_thread(
        lambda ready, stop: kvpool.serve("127.0.0.1", port, 3 * 1000, ev, token=TOKEN,
                                         ready=ready, stop=stop), "kvpool")
    yield f"http://127.0.0.1:{port}", ev, server
    server.close()


def put(url: str, hashes: list[int], parent: int | None = None) -> httpx.Response:
    blocks = []
    for h in hashes:
        blocks.append({"hash": h, "parent": parent, "token_ids": list(range(4)), "salt": None})
        parent = h
    return httpx.post(f"{url}/v1/kv/put", headers=AUTH,
                      json={"block_size": 4, "bytes_per_block": 1000, "blocks": blocks})


def value(text: str, name: str) -> float:
    return sum(float(x.split()[-1]) for x in text.splitlines() if x.startswith(name + " "))


def test_puts_lookups_fetches_and_the_lru(pool: tuple[str, KVEventsConfig, ServerThread]
                                          ) -> None:
    url, _, _ = pool
    assert put(url, [11, 12]).json() == {"stored": 2}
    lookup = httpx.post(f"{url}/v1/kv/lookup", headers=AUTH, json={"hashes": [11, 12, 13]})
    assert lookup.json() == {"matched": 2}
    assert httpx.post(f"{url}/v1/kv/fetch", headers=AUTH, json={"hashes": [11]}).json() == {
        "fetched": 1, "bytes": 1000}
    put(url, [20, 21], None)  # 3,000 bytes of capacity: 12 (least recent) is evicted
    lookup = httpx.post(f"{url}/v1/kv/lookup", headers=AUTH, json={"hashes": [11, 12]})
    assert lookup.json()["matched"] == 1
    m = httpx.get(f"{url}/metrics").text
    assert value(m, "tokengate_kvpool_blocks") == 3
    assert value(m, "tokengate_kvpool_used_bytes") == 3000
    assert value(m, "tokengate_kvpool_evictions_total") == 1
    assert value(m, "tokengate_kvpool_bytes_out_total") == 1000
    assert httpx.get(f"{url}/health").status_code == 200


@pytest.mark.parametrize("path,body", [
    ("lookup", b"not json"),
    ("lookup", b'["a list"]'),
    ("lookup", b'{"hashes": [-1]}'),
    ("lookup", b'{"hashes": [18446744073709551616]}'),
    ("fetch", b'{"hashes": "abc"}'),
    ("put", b'{"block_size": 4, "bytes_per_block": 10, "blocks": [{"hash": true}]}'),
    ("put", b'{"block_size": 4, "bytes_per_block": 10, '
            b'"blocks": [{"hash": 1, "token_ids": [1, 2, 3, 4, 5]}]}'),
    ("put", b'{"block_size": 0, "bytes_per_block": 10, "blocks": []}'),
])
def test_bad_input_gets_an_openai_shaped_400(pool: tuple[str, KVEventsConfig, ServerThread],
                                             path: str, body: bytes) -> None:
    url, _, _ = pool
    r = httpx.post(f"{url}/v1/kv/{path}", content=body,
                   headers={"Content-Type": "application/json", **AUTH})
    assert r.status_code == 400
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert "Traceback" not in r.text


def test_the_pool_events_reach_the_precise_index(
        pool: tuple[str, KVEventsConfig, ServerThread]) -> None:
    url, ev, _ = pool
    index = PreciseIndex(same_hashes=True)

    async def go() -> None:
        followers = KVEventFollowers()
        followers.follow(url, KVEvents(ev.endpoint, ev.replay_endpoint), index.apply,
                         index.clear)
        try:
            deadline = time.monotonic() + 10
            while index.size(url, "POOL") < 3 and time.monotonic() < deadline:
                await asyncio.to_thread(put, url, [31, 32, 33])
                await asyncio.sleep(0.2)
            assert index.size(url, "POOL") == 3
            await asyncio.to_thread(put, url, [41, 42])  # evicts 31 and 32 (LRU, 3 blocks)
            for _ in range(200):
                if index.size(url, "POOL") == 3 and 31 not in _held(index, url):
                    break
                await asyncio.sleep(0.05)
            assert index.walk(url, "POOL", [41, 42, 33], 0, 3) == 3
            assert index.walk(url, "POOL", [31], 0, 1) == 0
        finally:
            await followers.close()

    asyncio.run(go())


def _held(index: PreciseIndex, url: str) -> set[int]:
    return {h for h in (31, 32, 33, 41, 42) if index.walk(url, "POOL", [h], 0, 1)}


@pytest.mark.parametrize("auth", [None, "Bearer wrong-token-of-some-length", f"Basic {TOKEN}",
                                  f"Bearer {TOKEN}x"])
def test_kv_routes_need_the_token(pool: tuple[str, KVEventsConfig, ServerThread],
                                  auth: str | None) -> None:
    url, _, _ = pool
    h = {"Authorization": auth} if auth else {}
    for path, doc in (("put", {"block_size": 4, "bytes_per_block": 1, "blocks": []}),
                      ("lookup", {"hashes": [1]}), ("fetch", {"hashes": [1]})):
        r = httpx.post(f"{url}/v1/kv/{path}", headers=h, json=doc)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(f"{url}/health").status_code == 200  # no KV data: open


def test_the_pool_does_not_start_without_a_token() -> None:
    import subprocess
    import sys

    env = {k: v for k, v in __import__("os").environ.items() if k != "TOKENGATE_KVPOOL_TOKEN"}
    r = subprocess.run([sys.executable, "-m", "tokengate", "kvpool", "--capacity-gb", "1",
                        "--port", str(free_port())], env=env, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 2 and "TOKENGATE_KVPOOL_TOKEN" in r.stderr
    with pytest.raises(ValueError, match="at least 16"):
        kvpool.build_app(1000, token="short")
