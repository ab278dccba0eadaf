"""Spend accounting: a record per request (to the log and, optionally, PostgreSQL), dollar
metrics, and spend by tenant, key, model, priority and day (``/admin/spend``)."""
