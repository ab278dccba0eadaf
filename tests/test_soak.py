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


# Skipped in `make test`: it is a 10-minute load run (its leak thresholds need that long to
# rise above warm-up; a 1-minute run reads +8 MiB/min of start-up growth), which the CI budget
# cannot hold beside the suite. The gateway-soak issue asked for it behind this flag.
@pytest.mark.skipif(not MINUTES, reason="a 10-minute soak: run it with TOKENGATE_SOAK=10 "
                    "(minutes) or `make soak`")
def test_soak(tmp_path: Path) -> None:
    assert soak.main(["--minutes", str(MINUTES), "--out", str(tmp_path)]) == 0
    rep = json.loads((tmp_path / "soak.json").read_text())
    assert rep["errors"] == 0 and rep["requests"] > 100
    slopes = rep["slopes_per_min"]
    # Flat: no fd or connection growing steadily (under one a minute: a leak of one per
    # request would be hundreds), and resident memory under 1.5 MiB/min over the second half
    # (measured: +0.99 after 10 minutes, +0.48 after 20, decelerating — RELIABILITY.md; a leak
    # of 2 KB per request at this load would be ~1.5 MiB/min).
    assert slopes["rss_mb"] < 1.5 and slopes["fds"] < 1.0 and slopes["upstream_conns"] < 1.0
