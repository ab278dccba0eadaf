"""Quotas: what a request reserves and is charged on every scope (``ledger``), the one place a
reservation is made (``admission``), and the token buckets it is kept in (``limiter``: GCRA,
the in-memory and Redis stores, their Lua scripts)."""
