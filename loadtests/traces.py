"""Request traces: the Azure LLM inference 2023 CSVs (arrival time, context and output tokens).

The public traces the load tests, benchmarks, simulator and docs use ship with the package in
``loadtests/data/traces`` (``TRACES``), with a README naming each one's publisher, source and
licence."""

from __future__ import annotations

import csv
import json
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

TRACES = Path(__file__).resolve().parent / "data" / "traces"


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One request of a trace: arrival offset from the first request, lengths in tokens."""

    t: float
    input_tokens: int
    output_tokens: int
    model: str | None = None  # a ``model`` column, where the trace has one (many models)


def _parse_ts(raw: str) -> datetime:
    # "2023-11-16 18:15:46.6805900": seven fractional digits, more than %f takes.
    head, _, frac = raw.strip().partition(".")
    return datetime.strptime(f"{head}.{(frac or '0')[:6]:0<6}", "%Y-%m-%d %H:%M:%S.%f")


def jsonl_rows(path: str | Path) -> Iterator[tuple[int, Any]]:
    """``(line number, parsed JSON)`` of each non-blank line (ValueError names a bad line)."""
    with open(path) as f:
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                yield line_no, json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{line_no}: not JSON ({exc})") from None


def load_azure(path: str | Path, *, window_s: float | None = None,
               limit: int | None = None) -> list[TraceRequest]:
    """Rows of an Azure LLM 2023 trace, as offsets from its first arrival.

    ``window_s`` keeps the arrivals of the first that many seconds; ``limit`` the first N rows.
    """
    out: list[TraceRequest] = []
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        expected = {"TIMESTAMP", "ContextTokens", "GeneratedTokens"}
        if not reader.fieldnames or not expected <= set(reader.fieldnames):
            raise ValueError(f"{path}: not an Azure LLM trace (columns {reader.fieldnames})")
        t0: datetime | None = None
        for line, row in enumerate(reader, start=2):
            try:
                ts = _parse_ts(row["TIMESTAMP"])
                ctx, gen = int(row["ContextTokens"]), int(row["GeneratedTokens"])
            except (ValueError, TypeError) as exc:
                raise ValueError(f"{path}:{line}: bad row: {exc}") from None
            t0 = t0 or ts
            t = (ts - t0).total_seconds()
            if window_s is not None and t > window_s:
                break
            out.append(TraceRequest(t, max(ctx, 1), max(gen, 1), row.get("model") or None))
            if limit is not None and len(out) >= limit:
                break
    return out
