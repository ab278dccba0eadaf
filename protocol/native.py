"""Which compiled parts of the request path this install has (``setup.py`` builds them with the
machine's C compiler; without one the install works, through the same code's Python form,
slower)."""

from __future__ import annotations

import importlib

# compiled module -> what is slower without it
PARTS = {"protocol._kvhash": "KV block hashing for prefix routing runs ~6x slower and holds "
                             "the GIL (a huge prompt slows every other request)"}


def missing() -> dict[str, str]:
    """The compiled parts this install lacks, and what that costs."""
    out = {}
    for name, cost in PARTS.items():
        try:
            importlib.import_module(name)
        except ImportError:
            out[name] = cost
    return out


def warning() -> str | None:
    """What a program says at start when compiled parts are missing (None: all there)."""
    gone = missing()
    if not gone:
        return None
    return ("running without compiled parts (no C compiler when this was installed; "
            "reinstall with one to build them): " + "; ".join(f"{k}: {v}" for k, v in gone.items()))
