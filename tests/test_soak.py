"""The soak, behind a flag: ``TOKENGATE_SOAK=10 make unit`` (minutes) or ``make soak``.

Ten minutes of mixed streaming load through one gateway process (loadtests/soak.py): no
errors, and memory, file descriptors and upstream connections flat over the second half."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from loadtests import soak

MINUTES = float(os.environ.get("TOKENGATE_SOAK", "0") or 0)


@pytest.mark.skipif(not MINUTES, reason="the soak runs only with TOKENGATE_SOAK=<minutes>")
def test_soak(tmp_path: Path) -> None:
    assert soak.main(["--minutes", str(MINUTES), "--out", str(tmp_path)]) == 0
    rep = json.loads((tmp_path / "soak.json").read_text())
    assert rep["errors"] == 0 and rep["requests"] > 100
    slopes = rep["slopes_per_min"]
    # Flat: under 1 MiB/min of resident memory, and no fd or connection growing steadily
    # (under one per minute: a leak of one per request would be hundreds).
    assert slopes["rss_mb"] < 1.0 and slopes["fds"] < 1.0 and slopes["upstream_conns"] < 1.0
