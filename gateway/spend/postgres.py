"""Spend records to PostgreSQL: batched, in the background, never on a request's path, each
record written once.

``put`` appends a record to a bounded buffer (full: the record is dropped and counted, and the
spend log still has it); a writer task inserts what has gathered every ``flush_s`` or once
``batch`` records wait: ``COPY`` into a temporary table, then one ``INSERT … ON CONFLICT
(request_id) DO NOTHING``, in one transaction and one round trip's worth of statements. A
batch whose answer was lost (a timeout: the database stalled, then committed it) is sent
again without a second row. Connecting and every statement have a timeout
(``connect_timeout_s``, ``statement_timeout_s``, the latter also set as the session's
``statement_timeout``); a batch that fails is kept and retried with the next, as long as the
buffer has room.

``close`` never holds shutdown past its ``timeout_s``: what it could not write by then goes
to the spool (``spool_dir``, one JSON line per record, a file per shutdown), and the next
start reads the spool back into the buffer before anything else; the unique ``request_id``
makes a record spooled after all being written harmless.

The schema is created and migrated at start: ``tokengate_schema`` holds the version applied,
each migration runs once, in a transaction, under an advisory lock (replicas starting together
apply it once).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import time
import uuid
from collections import deque
from datetime import UTC, datetime
from pathlib import Path

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
    # one row per request: duplicates an earlier version wrote (a batch sent again after its
    # answer was lost) go, and the request id becomes the key; the route, for budgets
    """
    DELETE FROM tokengate_spend a USING tokengate_spend b
        WHERE a.request_id = b.request_id AND a.ctid > b.ctid;
    CREATE UNIQUE INDEX IF NOT EXISTS tokengate_spend_request_id
        ON tokengate_spend (request_id);
    ALTER TABLE tokengate_spend ADD COLUMN IF NOT EXISTS route text;
    """,
)
COLUMNS = ("at", "request_id", "tenant", "key_name", "model", "priority", "prompt_tokens",
           "completion_tokens", "cached_tokens", "dollars", "outcome", "endpoint", "session",
           "tier", "route")
_STAGE = "tokengate_spend_in"


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


def default_spool_dir() -> Path:
    """``$TOKENGATE_SPOOL_DIR``, else ``$XDG_STATE_HOME/tokengate/spend-spool`` (by default
    ``~/.local/state/tokengate/spend-spool``)."""
    env = os.environ.get("TOKENGATE_SPOOL_DIR")
    if env:
        return Path(env)
    state = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(state) / "tokengate" / "spend-spool"


class PostgresSink:
    def __init__(self, url: str, *, batch: int = 500, flush_s: float = 0.5,
                 capacity: int = 50_000, connect_timeout_s: float = 5.0,
                 statement_timeout_s: float = 10.0, spool_dir: Path | None = None) -> None:
        self.url = url
        self.batch = batch
        self.flush_s = flush_s
        self.buffer: deque[SpendRecord] = deque()
        self.capacity = capacity
        self.connect_timeout_s = connect_timeout_s
        self.statement_timeout_s = statement_timeout_s
        self.spool_dir = spool_dir or default_spool_dir()
        self.written = self.dropped = self.failures = self.spooled = self.replayed = 0
        self._wake = asyncio.Event()
        self._conn: asyncpg.Connection | None = None
        self._lock = asyncio.Lock()  # one batch in flight at a time
        self.replay_spool()

    def put(self, rec: SpendRecord) -> None:
        if len(self.buffer) >= self.capacity:
            self.dropped += 1
            return
        self.buffer.append(rec)
        if len(self.buffer) >= self.batch:
            self._wake.set()

    async def run(self) -> None:
        try:  # the schema is there from the start, not from the first record
            async with self._lock:
                await self._connect()
        except (OSError, TimeoutError, asyncpg.PostgresError, asyncpg.InterfaceError) as exc:
            log.warning("PostgreSQL for spend records is not reachable yet (%s)", exc)
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.flush_s)
            self._wake.clear()
            await self.flush()

    async def flush(self) -> None:
        async with self._lock:
            while self.buffer:
                recs = list(self.buffer)[:self.batch]
                try:
                    await self._write(recs)
                except (OSError, TimeoutError, asyncpg.PostgresError,
                        asyncpg.InterfaceError) as exc:
                    self.failures += 1
                    log.warning("spend records not written to PostgreSQL yet (%s); %d "
                                "waiting", exc or type(exc).__name__, len(self.buffer))
                    self._drop_connection()
                    return
                for _ in recs:
                    self.buffer.popleft()
                self.written += len(recs)

    async def _write(self, recs: list[SpendRecord]) -> None:
        conn = await self._connect()
        t = self.statement_timeout_s
        async with conn.transaction():
            await conn.copy_records_to_table(_STAGE, records=[_row(r) for r in recs],
                                             columns=COLUMNS, timeout=t)
            await conn.execute(f"INSERT INTO tokengate_spend ({', '.join(COLUMNS)}) "
                               f"SELECT {', '.join(COLUMNS)} FROM {_STAGE} "
                               "ON CONFLICT (request_id) DO NOTHING", timeout=t)

    async def _connect(self) -> asyncpg.Connection:
        if self._conn is None or self._conn.is_closed():
            conn = await asyncpg.connect(
                self.url, timeout=self.connect_timeout_s,
                command_timeout=self.statement_timeout_s,
                server_settings={"statement_timeout": str(int(self.statement_timeout_s * 1000))})
            try:
                await asyncio.wait_for(self._prepare(conn), self.statement_timeout_s)
            except BaseException:
                conn.terminate()
                raise
            self._conn = conn
        return self._conn

    @staticmethod
    async def _prepare(conn: asyncpg.Connection) -> None:
        await migrate(conn)
        await conn.execute(f"CREATE TEMP TABLE IF NOT EXISTS {_STAGE} (LIKE tokengate_spend "
                           "INCLUDING DEFAULTS) ON COMMIT DELETE ROWS")

    def _drop_connection(self) -> None:
        """Forget the connection without waiting on it (a stalled server answers nothing)."""
        if self._conn is not None:
            self._conn.terminate()
            self._conn = None

    async def close(self, timeout_s: float = 5.0) -> None:
        """Write what waits within ``timeout_s``; spool the rest; close the connection."""
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.flush(), timeout_s)
        self._drop_connection()
        if self.buffer:
            self.spool()

    # -- the spool ------------------------------------------------------------------------
    def spool(self) -> None:
        """Write the records still waiting to a new spool file (read at the next start)."""
        try:
            self.spool_dir.mkdir(parents=True, exist_ok=True)
            tmp = self.spool_dir / f".{uuid.uuid4().hex}.tmp"
            with tmp.open("w") as f:
                for r in self.buffer:
                    f.write(json.dumps(r.as_dict(), separators=(",", ":")) + "\n")
            name = f"spend-{time.time():.6f}-{os.getpid()}.jsonl"
            tmp.rename(self.spool_dir / name)
        except OSError as exc:
            log.error("%d spend records could not be spooled to %s (%s); the spend log has "
                      "them", len(self.buffer), self.spool_dir, exc)
            return
        self.spooled += len(self.buffer)
        log.warning("%d spend records not written to PostgreSQL by shutdown: spooled to %s, "
                    "written at the next start", len(self.buffer), self.spool_dir / name)
        self.buffer.clear()

    def replay_spool(self) -> None:
        """Take every spool file's records into the buffer (before anything new) and remove
        the file: a file is read once, by the first replica to claim it."""
        try:
            files = sorted(self.spool_dir.glob("spend-*.jsonl"))
        except OSError:
            return
        for path in files:
            claimed = path.with_suffix(f".{os.getpid()}.claimed")
            try:
                path.rename(claimed)  # atomic: two replicas sharing a spool read it once
                lines = claimed.read_text().splitlines()
            except OSError:
                continue
            recs = []
            for line in lines:
                with contextlib.suppress(ValueError, TypeError):
                    recs.append(SpendRecord(**json.loads(line)))
            self.buffer.extend(recs)
            self.replayed += len(recs)
            claimed.unlink(missing_ok=True)
            log.info("%d spooled spend records from %s to write", len(recs), path)


def _row(r: SpendRecord) -> tuple[object, ...]:
    return (datetime.fromtimestamp(r.at, UTC), r.request_id, r.tenant, r.key, r.model,
            r.priority, r.prompt_tokens, r.completion_tokens, r.cached_tokens, r.dollars,
            r.outcome, r.endpoint, r.session, r.tier, r.route)
