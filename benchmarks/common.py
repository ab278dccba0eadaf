"""What every benchmark shares: its command line's common flags, the time stamp of a run,
writing its report (``report.json`` or a named file under ``--out``) and printing its summary,
and reading a reference backend's per-request times, so each script holds only what it
measures."""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp


def parser(doc: str | None, name: str | None = None) -> argparse.ArgumentParser:
    """A benchmark's command line, its module docstring as the help; with ``name``, an
    ``--out`` folder (default: ``bench-NAME`` in the temporary directory)."""
    p = argparse.ArgumentParser(description=doc,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    if name is not None:
        p.add_argument("--out", default=str(Path(tempfile.gettempdir()) / f"bench-{name}"),
                       help="folder for the report")
    return p


def rounds(p: argparse.ArgumentParser, clients: int | str) -> None:
    """The flags of benchmarks that alternate targets in rounds of load runs (``clients``: a
    number, or comma-separated numbers for several load levels)."""
    p.add_argument("--rounds", type=int, default=3, help="rounds (every one is reported)")
    p.add_argument("--requests", type=int, default=200, help="per target, one client")
    p.add_argument("--seconds", type=float, default=5.0, help="per load run")
    p.add_argument("--clients", type=type(clients), default=clients,
                   help="concurrent clients of the load runs")


def when() -> str:
    """The run's time stamp, as reports carry it."""
    return time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())


def write(out: str | Path, data: Any, name: str = "report.json") -> Path:
    """``data`` as JSON in ``out/name`` (the folder made if needed)."""
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    path.write_text(json.dumps(data, indent=2))
    return path


def show(data: Any) -> None:
    """Print a summary as indented JSON."""
    print(json.dumps(data, indent=2))


async def engine_requests(http: aiohttp.ClientSession, port: int) -> dict[str, Any]:
    """The latest finished requests of the reference backend on ``port``, by their
    ``X-Request-Id`` (its ``/admin/requests``: arrival, scheduled, first_token, finished on
    the host's monotonic clock)."""
    async with http.get(f"http://127.0.0.1:{port}/admin/requests") as resp:
        return {e["id"]: e for e in (await resp.json())["requests"]}
