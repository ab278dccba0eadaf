"""The repository carries every file its code, tests and benchmarks read: no path reaches
outside it (a sibling checkout beside this one, an absolute path of some machine), and the
public traces ship in the package with their publisher, source and licence."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

from loadtests.traces import TRACES

ROOT = Path(__file__).resolve().parent.parent
# Reports of past runs record where their inputs were on the machine that ran them.
HISTORY = ("benchmarks/results/",)
# The sibling folder a checkout of this project once read, named in pieces so this file does
# not itself name a path outside the repository.
SIBLING = "shared"
OUTSIDE = re.compile(rf"\.\./{SIBLING}|/work/{SIBLING}|parents\[2\]\s*/\s*\"{SIBLING}\"|"
                     rf"parent\s*/\s*\"{SIBLING}\"")


def _tracked() -> list[Path]:
    out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"],
                         cwd=ROOT, capture_output=True, text=True, check=True).stdout
    return [ROOT / p for p in out.splitlines()
            if p.endswith((".py", ".sh", ".toml", ".yaml", ".yml", ".cfg", ".json"))
            or Path(p).name in ("Makefile", "Dockerfile")
            if not p.startswith(HISTORY)]


def test_nothing_reads_outside_the_repository() -> None:
    here = Path(__file__).resolve()
    found = [f"{p.relative_to(ROOT)}:{i}" for p in _tracked() if p != here and p.is_file()
             for i, line in enumerate(p.read_text(errors="replace").splitlines(), 1)
             if OUTSIDE.search(line)]
    assert not found, found


def test_the_traces_ship_with_their_licences() -> None:
    readme = (TRACES / "README.md").read_text()
    files = sorted(p.name for p in TRACES.iterdir() if p.name != "README.md")
    assert files == ["azure_llm_2023_code.csv", "azure_llm_2023_conv.csv",
                     "mooncake_synthetic.jsonl"]
    for name in files:
        row = next(line for line in readme.splitlines() if f"`{name}`" in line)
        assert ("CC-BY-4.0" in row) if name.startswith("azure") else ("Apache-2.0" in row)
        assert (TRACES / name).stat().st_size > 100_000
