"""The spend ledger's PostgreSQL writer against a real PostgreSQL, reached through a TCP relay
that can stall (the database stopped, a partition): shutdown never waits past its timeout,
what could not be written is spooled and written at the next start, a batch sent twice (its
answer lost) leaves one row per request, and a stalled connect or statement times out."""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import asyncpg
import httpx
import pytest
from conftest import RunningBackend
from gateway_stack import RunningGateway, start_gateway, write_policy
from redis_servers import RedisServer
from test_gateway_e2e import sha

from gateway.spend.postgres import PostgresSink
from gateway.spend.record import SpendRecord

PG_HOST, PG_PORT = "127.0.0.1", 5432


class StallingRelay:
    """Forwards TCP to PostgreSQL; ``stall()`` stops forwarding both ways (bytes wait),
    ``resume()`` delivers them."""

    def __init__(self) -> None:
        self.open = asyncio.Event()
        self.open.set()
        self.server: asyncio.Server | None = None
        self.port = 0
        self.tasks: set[asyncio.Task[None]] = set()
        self.writers: list[asyncio.StreamWriter] = []

    async def start(self) -> None:
        self.server = await asyncio.start_server(self._client, "127.0.0.1", 0)
        self.port = self.server.sockets[0].getsockname()[1]

    def stall(self) -> None:
        self.open.clear()

    def resume(self) -> None:
        self.open.set()

    async def _pipe(self, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        with contextlib.suppress(Exception):
            while data := await r.read(65536):
                await self.open.wait()
                w.write(data)
                await w.drain()
        with contextlib.suppress(Exception):
            w.close()

    async def _client(self, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        self.writers.append(w)
        await self.open.wait()
        ur, uw = await asyncio.open_connection(PG_HOST, PG_PORT)
        self.writers.append(uw)
        for a, b in ((r, uw), (ur, w)):
            t = asyncio.ensure_future(self._pipe(a, b))
            self.tasks.add(t)
            t.add_done_callback(self.tasks.discard)

    async def close(self) -> None:
        assert self.server is not None
        self.server.close()
        for t in list(self.tasks):
            t.cancel()
        for w in self.writers:
            w.close()
            with contextlib.suppress(Exception):
                await w.wait_closed()
        await self.server.wait_closed()

    @property
    def url(self) -> str:
        return f"postgresql://127.0.0.1:{self.port}/test"


def rec(rid: str, dollars: float = 0.01) -> SpendRecord:
    return SpendRecord(time.time(), rid, "t", "k", "m", "standard", 10, 5, 0, dollars, "200",
                       route="r")


async def rows(ids: list[str]) -> dict[str, int]:
    conn = await asyncpg.connect(f"postgresql://{PG_HOST}:{PG_PORT}/test")
    try:
        got = await conn.fetch("SELECT request_id, count(*) AS n FROM tokengate_spend WHERE "
                               "request_id = ANY($1::text[]) GROUP BY request_id", ids)
        return {r["request_id"]: r["n"] for r in got}
    finally:
        await conn.close()


def test_a_stalled_database_holds_shutdown_no_longer_than_asked_and_nothing_is_lost(
        tmp_path: Path) -> None:
    async def main() -> None:
        relay = StallingRelay()
        await relay.start()
        spool = tmp_path / "spool"
        sink = PostgresSink(relay.url, flush_s=0.05, statement_timeout_s=30.0,
                            spool_dir=spool)
        run = asyncio.ensure_future(sink.run())
        try:
            first = [f"pg-{uuid.uuid4().hex}" for _ in range(5)]
            for rid in first:
                sink.put(rec(rid))
            for _ in range(100):
                if sink.written >= 5:
                    break
                await asyncio.sleep(0.05)
            assert sink.written == 5
            relay.stall()  # the database stops answering (SIGSTOP, a partition)
            later = [f"pg-{uuid.uuid4().hex}" for _ in range(5)]
            for rid in later:
                sink.put(rec(rid))
            await asyncio.sleep(0.3)  # a batch is in flight, stuck
            t0 = time.monotonic()
            await sink.close(1.0)
            took = time.monotonic() - t0
            assert took < 2.0, took  # it waited 40 s for the database to come back
            assert sink.spooled == 5 and not sink.buffer
            assert len(list(spool.glob("spend-*.jsonl"))) == 1
        finally:
            run.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await run
            relay.resume()
            await asyncio.sleep(0.3)  # whatever the relay held reaches the database
            await relay.close()
        # the next start writes the spooled records, each once (even one the stalled batch
        # had written after all)
        again = PostgresSink(f"postgresql://{PG_HOST}:{PG_PORT}/test", spool_dir=spool)
        assert again.replayed == 5 and not list(spool.glob("spend-*.jsonl"))
        await again.flush()
        await again.close()
        got = await rows(first + later)
        assert got == {rid: 1 for rid in first + later}
    asyncio.run(main())


def test_a_batch_sent_again_writes_each_request_once() -> None:
    async def main() -> None:
        sink = PostgresSink(f"postgresql://{PG_HOST}:{PG_PORT}/test")
        ids = [f"pg-{uuid.uuid4().hex}" for _ in range(3)]
        batch = [rec(i) for i in ids]
        await sink._write(batch)
        await sink._write(batch)  # its answer was lost: sent again
        await sink._write([rec(ids[0], dollars=9.0)])
        await sink.close()
        assert await rows(ids) == {i: 1 for i in ids}
    asyncio.run(main())


def test_a_database_that_never_answers_times_out() -> None:
    async def main() -> None:
        relay = StallingRelay()
        await relay.start()
        relay.stall()  # accepts, answers nothing
        sink = PostgresSink(relay.url, connect_timeout_s=0.5, statement_timeout_s=0.5)
        sink.put(rec(f"pg-{uuid.uuid4().hex}"))
        t0 = time.monotonic()
        await sink.flush()
        assert time.monotonic() - t0 < 2.0 and sink.failures == 1 and len(sink.buffer) == 1
        sink.buffer.clear()
        await sink.close(0.2)
        await relay.close()
    asyncio.run(main())


def test_budgets_survive_a_redis_restart_rebuilt_from_the_ledger(
        backend_factory: Callable[..., RunningBackend], tmp_path: Path) -> None:
    """Two replicas, a real Redis without persistence and PostgreSQL: a tenant spends part of
    its monthly budget; Redis restarts empty; the replicas notice and lift the budget back to
    what the ledger says was spent (it read $0 spent, the month forgotten)."""
    b = backend_factory()
    redis = RedisServer(tmp_path / "redis")
    run = uuid.uuid4().hex[:8]
    tenant, model, route = f"t{run}", f"m{run}", f"r{run}"
    doc = {"version": 1,
           "settings": {"admin_key_sha256": sha("admin"),
                        "spend": {"postgres_url": f"postgresql://{PG_HOST}:{PG_PORT}/test",
                                  "spool_dir": str(tmp_path / "spool"), "log": False}},
           "models": {model: {"endpoints": [{"url": f"{b.url}/v1"}],
                              "upstream_model": "llama-3-8b", "default_max_tokens": 8,
                              "price": {"input_per_1k": 1.0, "output_per_1k": 2.0}}},
           "tenants": {tenant: {"keys": [{"sha256": sha("key-t")}],
                                "limits": {"budget_monthly": 5.0}}},
           "routes": {route: {"tenants": [tenant], "models": [model]}}}
    path = write_policy(tmp_path / "p.yaml", doc)
    gws = [start_gateway(path, redis_url=redis.url) for _ in range(2)]

    def used(gw: RunningGateway) -> float:
        lim = httpx.get(f"{gw.url}/admin/limiter", headers={"Authorization": "Bearer admin"}
                        ).json()
        return sum(x["used"] for x in lim["buckets"]
                   if x["kind"] == "budget_monthly" and x["scope"].startswith("tenant:"))

    try:
        for i in range(6):
            r = httpx.post(f"{gws[i % 2].url}/v1/completions",
                           headers={"Authorization": "Bearer key-t"}, timeout=30,
                           json={"model": model, "prompt": f"hello {i} " * 20,
                                 "max_tokens": 8})
            assert r.status_code == 200
        deadline = time.monotonic() + 10
        spent = used(gws[0])
        while asyncio.run(_ledger(tenant)) < spent - 1e-9 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert asyncio.run(_ledger(tenant)) == pytest.approx(spent) and spent > 0.05
        redis.stop()
        redis.start()  # empty: it keeps nothing on disk
        for gw in gws:
            deadline = time.monotonic() + 15
            while time.monotonic() < deadline:
                with contextlib.suppress(Exception):
                    if used(gw) == pytest.approx(spent, rel=1e-6):
                        break
                time.sleep(0.1)
            assert used(gw) == pytest.approx(spent, rel=1e-6)
    finally:
        for gw in gws:
            gw.close()
        redis.stop()


async def _ledger(tenant: str) -> float:
    conn = await asyncpg.connect(f"postgresql://{PG_HOST}:{PG_PORT}/test")
    try:
        v = await conn.fetchval("SELECT coalesce(sum(dollars), 0) FROM tokengate_spend "
                                "WHERE tenant = $1", tenant)
        return float(v)
    finally:
        await conn.close()


def test_the_database_url_comes_from_the_environment_and_its_password_is_never_shown(
        backend_factory: Callable[..., RunningBackend], tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``postgres_url_env``: records reach the database the variable names; a password in a
    ``postgres_url`` is shown as ``***`` by ``/admin/policy``."""
    b = backend_factory()
    monkeypatch.setenv("TG_TEST_SPEND_PG", f"postgresql://{PG_HOST}:{PG_PORT}/test")

    def policy(spend: dict[str, str]) -> Path:
        return write_policy(tmp_path / f"p{len(spend)}.yaml", {
            "version": 1,
            "settings": {"admin_key_sha256": sha("admin"),
                         "spend": {"spool_dir": str(tmp_path / "spool"), "log": False,
                                   **spend}},
            "models": {"m": {"endpoints": [{"url": f"{b.url}/v1"}],
                             "upstream_model": "llama-3-8b", "default_max_tokens": 4}},
            "tenants": {"t": {"keys": [{"sha256": sha("key-t")}]}},
            "routes": {"r": {"tenants": ["t"], "models": ["m"]}}})

    gw = start_gateway(policy({"postgres_url_env": "TG_TEST_SPEND_PG"}))
    try:
        r = httpx.post(f"{gw.url}/v1/completions", headers={"Authorization": "Bearer key-t"},
                       json={"model": "m", "prompt": "hello", "max_tokens": 4}, timeout=30)
        assert r.status_code == 200
        rid = r.headers["x-request-id"]
        deadline = time.monotonic() + 10
        while asyncio.run(rows([rid])) != {rid: 1} and time.monotonic() < deadline:
            time.sleep(0.1)
        assert asyncio.run(rows([rid])) == {rid: 1}
    finally:
        gw.close()
    secret = f"postgresql://tokengate:s3cr%40t-pw@{PG_HOST}:{PG_PORT}/test"
    gw = start_gateway(policy({"postgres_url": secret}))
    try:
        shown = httpx.get(f"{gw.url}/admin/policy", timeout=10,
                          headers={"Authorization": "Bearer admin"})
        assert shown.status_code == 200 and "s3cr" not in shown.text
        assert shown.json()["settings"]["spend"]["postgres_url"] == \
            f"postgresql://tokengate:***@{PG_HOST}:{PG_PORT}/test"
    finally:
        gw.close()
