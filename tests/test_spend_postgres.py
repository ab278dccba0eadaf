"""The spend ledger's PostgreSQL writer against a real PostgreSQL, reached through a TCP relay
that can stall (the database stopped, a partition): shutdown never waits past its timeout,
what could not be written is spooled and written at the next start, a batch sent twice (its
answer lost) leaves one row per request, and a stalled connect or statement times out."""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from pathlib import Path

import asyncpg

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
