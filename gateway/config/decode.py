"""Strict decoding of policy documents: unknown keys and wrong types are errors that name the
file, the path inside it and the reason."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Mapping
from typing import Any, TypeVar

T = TypeVar("T")


class PolicyError(ValueError):
    """An invalid policy; the message names file, path and reason."""


class Decoder:
    """Decodes one policy file strictly: every failure names the file, the path and why."""

    def __init__(self, source: str) -> None:
        self.source = source

    def fail(self, path: str, reason: str) -> PolicyError:
        return PolicyError(f"{self.source}: {path or '<root>'}: {reason}")

    def mapping(self, raw: Any, path: str, allowed: set[str],
                required: set[str] = frozenset()) -> dict[str, Any]:  # type: ignore[assignment]
        if not isinstance(raw, Mapping):
            raise self.fail(path, f"expected a mapping, got {type(raw).__name__}")
        for k in raw:
            if k not in allowed:
                raise self.fail(f"{path}.{k}" if path else str(k),
                                f"unknown key (allowed: {', '.join(sorted(allowed))})")
        for k in required:
            if k not in raw:
                raise self.fail(path, f"missing required key '{k}'")
        return dict(raw)

    def number(self, raw: Any, path: str, *, positive: bool = True) -> float:
        if isinstance(raw, str):
            with contextlib.suppress(ValueError):
                raw = float(raw)
        if isinstance(raw, bool) or not isinstance(raw, int | float):
            raise self.fail(path, f"expected a number, got {raw!r}")
        if positive and raw <= 0:
            raise self.fail(path, f"must be positive, got {raw}")
        if raw < 0:
            raise self.fail(path, f"must not be negative, got {raw}")
        return float(raw)

    def integer(self, raw: Any, path: str) -> int:
        if isinstance(raw, bool) or not isinstance(raw, int) or raw <= 0:
            raise self.fail(path, f"expected a positive integer, got {raw!r}")
        return raw

    def boolean(self, raw: Any, path: str) -> bool:
        if not isinstance(raw, bool):
            raise self.fail(path, f"expected true or false, got {raw!r}")
        return raw

    def string(self, raw: Any, path: str) -> str:
        if not isinstance(raw, str) or not raw:
            raise self.fail(path, f"expected a non-empty string, got {raw!r}")
        return raw

    def choice(self, raw: Any, path: str, allowed: set[str]) -> Any:
        if raw not in allowed:
            raise self.fail(path, f"expected one of {', '.join(sorted(allowed))}, got {raw!r}")
        return raw

    def strings(self, raw: Any, path: str) -> tuple[str, ...]:
        if not isinstance(raw, list):
            raise self.fail(path, "expected a list of strings")
        return tuple(self.string(x, f"{path}[{i}]") for i, x in enumerate(raw))

    def fields(self, m: Mapping[str, Any], path: str, keys: Iterable[str],
               parse: Callable[[Any, str], T]) -> dict[str, T]:
        """Each of ``keys`` that ``m`` holds, decoded by ``parse`` at ``path.key``."""
        return {k: parse(m[k], f"{path}.{k}") for k in keys if k in m}
