"""What the configuration schema is made of: a key's type, default and meaning (``Key``), a
section of keys (``Section``), and the two defaults that are not values."""

from __future__ import annotations

from dataclasses import dataclass, field

REQUIRED = object()  # the key has no default: it must be given
NONE = object()  # absent by default (the feature is off, or another value decides)


@dataclass(frozen=True, slots=True)
class Key:
    type: str
    default: object
    doc: str


@dataclass(frozen=True, slots=True)
class Section:
    path: str  # where it sits in a policy file
    doc: str
    keys: dict[str, Key] = field(default_factory=dict)


def spec(type_: str, default: object, doc: str) -> Key:
    return Key(type_, default, doc)
