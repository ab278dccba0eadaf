"""Spend records to PostgreSQL: batched, in the background, never on a request's path.

``put`` appends a record to a bounded buffer (full: the record is dropped and counted, and the
spend log still has it); a writer task inserts what has gathered every ``flush_s`` or once
``batch`` records wait, with ``COPY`` (one round trip per batch). A batch that fails (the
database away) is kept and retried with the next, as long as the buffer has room. The schema
is created and migrated at start: ``tokengate_schema`` holds the version applied, each
migration runs once, in a transaction, under an advisory lock (replicas starting together
apply it once).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from datetime import UTC, datetime

import asyncpg

from gateway.spend.record import SpendRecord

log = logging.getLogger("tokengate.spend")
LOCK_ID = 0x746F6B656E  # pg_advisory_xact_lock key of schema migrations ("token")
MIGRATIONS: tuple[str, ...] = (
    """
    CREATE TABLE IF NOT EXISTS tokengate_spend (
        at timestamptz NOT NULL,
        request_id text NOT NULL,
        tenant text NOT NULL,
        key_name text NOT NULL,
        model text NOT NULL,
        priority text NOT NULL,
        prompt_tokens integer NOT NULL,
        completion_tokens integer NOT NULL,
        cached_tokens integer NOT NULL,
        dollars double precision NOT NULL,
        outcome text NOT NULL,
        endpoint text,
        session text
    );
    CREATE INDEX IF NOT EXISTS tokengate_spend_tenant_at ON tokengate_spend (tenant, at);
    """,
    """
    ALTER TABLE tokengate_spend ADD COLUMN IF NOT EXISTS tier text NOT NULL DEFAULT 'payg';
    """,
)
COLUMNS = ("at", "request_id", "tenant", "key_name", "model", "priority", "prompt_tokens",
           "completion_tokens", "cached_tokens", "dollars", "outcome", "endpoint", "session",
           "tier")


async def migrate(conn: asyncpg.Connection) -> int:
    """Bring the schema to the latest version; returns it."""
    async with conn.transaction():
        await conn.execute("SELECT pg_advisory_xact_lock($1)", LOCK_ID)
        await conn.execute("CREATE TABLE IF NOT EXISTS tokengate_schema (version integer "
                           "NOT NULL)")
        have = await conn.fetchval("SELECT max(version) FROM tokengate_schema") or 0
        for version, sql in enumerate(MIGRATIONS[have:], start=have + 1):
            await conn.execute(sql)
            await conn.execute("INSERT INTO tokengate_schema (version) VALUES ($1)", version)
    return len(MIGRATIONS)


class PostgresSink:
    def __init__(self, url: str, *, batch: int = 500, flush_s: float = 0.5,
                 capacity: int = 50_000) -> None:
        self.url = url
        self.batch = batch
        self.flush_s = flush_s
        self.buffer: deque[SpendRecord] = deque()
        self.capacity = capacity
        self.written = self.dropped = self.failures = 0
        self._wake = asyncio.Event()
        self._conn: asyncpg.Connection | None = None

    def put(self, rec: SpendRecord) -> None:
        if len(self.buffer) >= self.capacity:
            self.dropped += 1
            return
        self.buffer.append(rec)
        if len(self.buffer) >= self.batch:
            self._wake.set()

    async def run(self) -> None:
        try:  # the schema is there from the start, not from the first record
            await self._connect()
        except (OSError, asyncpg.PostgresError, asyncpg.InterfaceError) as exc:
            log.warning("PostgreSQL for spend records is not reachable yet (%s)", exc)
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.flush_s)
            self._wake.clear()
            await self.flush()

    async def flush(self) -> None:
        while self.buffer:
            rows = [_row(r) for r in list(self.buffer)[:self.batch]]
            try:
                conn = await self._connect()
                await conn.copy_records_to_table("tokengate_spend", records=rows,
                                                 columns=COLUMNS)
            except (OSError, asyncpg.PostgresError, asyncpg.InterfaceError) as exc:
                self.failures += 1
                log.warning("spend records not written to PostgreSQL yet (%s); %d waiting",
                            exc, len(self.buffer))
                await self._drop_connection()
                return
            for _ in rows:
                self.buffer.popleft()
            self.written += len(rows)

    async def _connect(self) -> asyncpg.Connection:
        if self._conn is None or self._conn.is_closed():
            conn = await asyncpg.connect(self.url, timeout=5)
            await migrate(conn)
            self._conn = conn
        return self._conn

    async def _drop_connection(self) -> None:
        if self._conn is not None:
            with contextlib.suppress(Exception):
                await self._conn.close(timeout=1)
            self._conn = None

    async def close(self) -> None:
        with contextlib.suppress(Exception):
            await self.flush()
        await self._drop_connection()


def _row(r: SpendRecord) -> tuple[object, ...]:
    return (datetime.fromtimestamp(r.at, UTC), r.request_id, r.tenant, r.key, r.model,
            r.priority, r.prompt_tokens, r.completion_tokens, r.cached_tokens, r.dollars,
            r.outcome, r.endpoint, r.session, r.tier)
