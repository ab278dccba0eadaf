"""Policy sections for surviving upstream faults: timeouts (settings defaults, per-route
overrides) and the retry policy (attempts, backoff, and the retry budget).

``timeouts``: ``connect_s`` (TCP connect), ``first_token_s`` (request sent → first streamed
event; a stream that stalls before it is retried on another endpoint), ``between_tokens_s``
(the longest gap between two streamed events once streaming), ``total_s`` (the whole
request; the only bound on a non-streamed response). A stalled request ends with an
OpenAI-shaped error (or an SSE error event) when its timeout passes, and is settled.

``client``: ``header_timeout_s``, ``body_timeout_s``, ``keepalive_s`` bound slow senders and
idle connections (``gateway.front.http_guard``).

``retries``: at most ``max_attempts`` endpoints per model, a jittered exponential backoff of
``backoff_ms`` · 2^(n−1) (capped at ``max_backoff_ms``) before a retry caused by an overload
answer (429/5xx or a stall; not before one after a refused connection), and a budget in the
manner of Finagle's: retries may add at most ``budget_ratio`` of the requests, plus
``min_per_s`` per second, so a failing fleet is not hit by a retry storm.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from gateway.config import schema
from gateway.config.decode import Decoder


@dataclass(frozen=True, slots=True)
class Timeouts:
    connect_s: float = 5.0
    first_token_s: float = 120.0
    between_tokens_s: float = 60.0
    total_s: float = 600.0
    # an attempt waits for its first token at most this many times the TTFT routing predicted
    # for it (never less than FIRST_TOKEN_FLOOR_S, never more than first_token_s)
    first_token_factor: float = 10.0


FIRST_TOKEN_FLOOR_S = 10.0


def first_token_wait(t: Timeouts, predicted_ttft_s: float | None) -> float:
    """How long an attempt waits for its first token: ``first_token_factor`` times its
    predicted TTFT, within ``FIRST_TOKEN_FLOOR_S`` .. ``first_token_s`` (the cap alone when
    nothing was predicted)."""
    if predicted_ttft_s is None or not predicted_ttft_s > 0:
        return t.first_token_s
    return min(t.first_token_s, max(FIRST_TOKEN_FLOOR_S,
                                     t.first_token_factor * predicted_ttft_s))


@dataclass(frozen=True, slots=True)
class Retries:
    max_attempts: int = 3
    backoff_ms: float = 25.0
    max_backoff_ms: float = 1000.0
    budget_ratio: float = 0.2
    min_per_s: float = 5.0


@dataclass(frozen=True, slots=True)
class ClientLimits:
    """How long a client may take to send its request head and body, and to sit idle on a
    kept-alive connection (slow senders are answered 408 and disconnected)."""

    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    keepalive_s: float = 75.0


def parse_client(d: Decoder, raw: Any, path: str) -> ClientLimits:
    if raw is None:
        return ClientLimits()
    m = d.mapping(raw, path, schema.keys("client"))
    return ClientLimits(**{k: d.number(v, f"{path}.{k}") for k, v in m.items()})


def parse_timeouts(d: Decoder, raw: Any, path: str, base: Timeouts) -> Timeouts:
    """``base`` with the fields ``raw`` gives replaced."""
    return replace(base, **partial_timeouts(d, raw, path))


def partial_timeouts(d: Decoder, raw: Any, path: str) -> dict[str, float]:
    """A route's overrides, applied over the settings' timeouts when the policy is built."""
    if raw is None:
        return {}
    m = d.mapping(raw, path, schema.keys("timeouts"))
    return {k: d.number(v, f"{path}.{k}") for k, v in m.items()}


def parse_retries(d: Decoder, raw: Any, path: str) -> Retries:
    if raw is None:
        return Retries()
    m = d.mapping(raw, path, schema.keys("retries"))
    kw: dict[str, Any] = {}
    for k, v in m.items():
        if k == "max_attempts":
            kw[k] = d.integer(v, f"{path}.{k}")
        elif k in ("budget_ratio", "min_per_s"):
            kw[k] = d.number(v, f"{path}.{k}", positive=False)
        else:
            kw[k] = d.number(v, f"{path}.{k}")
    return Retries(**kw)
