"""The example policies shipped inside the package (``gateway/policies/``): ``tokengate up``
serves ``demo.yaml`` unless told otherwise, and ``tokengate policy example`` prints any of
them as a starting point."""

from __future__ import annotations

from pathlib import Path

POLICIES = Path(__file__).resolve().parent / "policies"
DEMO_POLICY = POLICIES / "demo.yaml"


def names() -> list[str]:
    """The examples' names (file names without ``.yaml``)."""
    return sorted(p.stem for p in POLICIES.glob("*.yaml"))


def path(name: str) -> Path:
    """An example's file; ``ValueError`` naming the choices for an unknown name."""
    if name not in names():
        raise ValueError(f"no example policy {name!r} (examples: {', '.join(names())})")
    return POLICIES / f"{name}.yaml"
