"""``POST /v1/embeddings`` requests, validated as OpenAI's API takes them: ``input`` a string,
a list of strings, a list of token ids or a list of such lists (at most ``MAX_INPUTS``, none
empty); ``encoding_format`` ``float`` or ``base64``; ``dimensions`` a positive integer;
``user``. Errors are 400s in OpenAI's shape naming the parameter."""

from __future__ import annotations

import base64
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from protocol.errors import bad

MAX_INPUTS = 2048  # OpenAI's limit on inputs per request
MAX_TOKEN_ID = 2**31
_KEYS = frozenset({"model", "input", "encoding_format", "dimensions", "user"})


@dataclass(frozen=True, slots=True)
class EmbeddingsRequest:
    model: str
    inputs: tuple[str | tuple[int, ...], ...]  # each text, or each token-id array
    encoding_format: str = "float"
    dimensions: int | None = None


def parse_embeddings(body: Any) -> EmbeddingsRequest:
    if not isinstance(body, Mapping):
        raise bad("the request body must be a JSON object")
    unknown = sorted(k for k in body if k not in _KEYS)
    if unknown:
        raise bad(f"Unknown parameter: '{unknown[0]}'.", unknown[0], code="unknown_parameter")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad("'model' must be a non-empty string", "model")
    fmt = body.get("encoding_format", "float")
    if fmt not in ("float", "base64"):
        raise bad("'encoding_format' must be 'float' or 'base64'", "encoding_format")
    dims = body.get("dimensions")
    if isinstance(dims, float) and dims.is_integer():
        dims = int(dims)  # 64.0 is 64, as JSON numbers go
    if dims is not None and (isinstance(dims, bool) or not isinstance(dims, int) or dims < 1):
        raise bad("'dimensions' must be a positive integer", "dimensions")
    return EmbeddingsRequest(model, _inputs(body.get("input")), fmt, dims)


def _inputs(raw: Any) -> tuple[str | tuple[int, ...], ...]:
    if isinstance(raw, str):
        raw = [raw]
    elif isinstance(raw, list) and raw and all(_is_id(x) for x in raw):
        raw = [raw]  # one token array
    if not isinstance(raw, list) or not raw:
        raise bad("'input' must be a string, a list of strings or a list of token arrays, "
                  "not empty", "input")
    if len(raw) > MAX_INPUTS:
        raise bad(f"'input' may hold at most {MAX_INPUTS} items, got {len(raw)}", "input")
    out: list[str | tuple[int, ...]] = []
    for i, x in enumerate(raw):
        if isinstance(x, str):
            if not x:
                raise bad(f"'input[{i}]' is empty", f"input[{i}]")
            out.append(x)
        elif isinstance(x, list) and x and all(_is_id(t) for t in x):
            out.append(tuple(int(t) for t in x))
        else:
            raise bad(f"'input[{i}]' must be a non-empty string or array of token ids",
                      f"input[{i}]")
    return tuple(out)


def _is_id(x: Any) -> bool:
    """A token id: an integer (2.0 is taken as 2, as JSON numbers go) within range."""
    if isinstance(x, float) and x.is_integer():
        x = int(x)
    return isinstance(x, int) and not isinstance(x, bool) and 0 <= x < MAX_TOKEN_ID


def encode_vector(vector: Sequence[float], fmt: str) -> list[float] | str:
    """An embedding as the API returns it: floats, or base64 of little-endian float32."""
    if fmt == "base64":
        return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()
    return list(vector)
