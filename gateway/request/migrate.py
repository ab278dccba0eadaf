"""Live request migration (ServerlessLLM's way: move the tokens, recompute the KV).

When an endpoint is drained (scale-in, maintenance through ``POST /admin/drain``), each stream
it is serving is cut from it and continued elsewhere without the client noticing: the gateway
re-sends the prompt plus the text generated so far to another endpoint — a completion's prompt
gets the text appended; a chat gets it as a final assistant message with
``continue_final_message`` (vLLM's option), whose token ids are exactly the original prompt's
followed by the generated tokens — asks for the remaining ``max_tokens``, and relays the new
stream into the same client response under the original completion id, from the next token.
The new endpoint recomputes the prompt's KV (helped by its prefix cache). The usage the client
receives, and the settlement, count the prompt once and every generated token once.

``Live`` is one relayed stream's handle: the relay keeps its content payloads (only in pools
that may migrate), and the drain sets ``migrating`` and cuts the upstream connection.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import orjson


@dataclass(slots=True, eq=False)
class Live:
    url: str
    cut: Callable[[], None]
    migrating: bool = False
    payloads: list[bytes] = field(default_factory=list)  # content chunks relayed so far

    def migrate(self) -> None:
        self.migrating = True
        self.cut()


class LiveStreams:
    """The streams in flight, by endpoint URL."""

    def __init__(self) -> None:
        self.by_url: dict[str, set[Live]] = {}

    def add(self, live: Live) -> None:
        self.by_url.setdefault(live.url, set()).add(live)

    def remove(self, live: Live) -> None:
        s = self.by_url.get(live.url)
        if s is not None:
            s.discard(live)
            if not s:
                del self.by_url[live.url]

    def migrate_from(self, url: str) -> int:
        """Move every stream off ``url``; how many were asked to move."""
        lives = list(self.by_url.get(url, ()))
        for live in lives:
            live.migrate()
        return len(lives)


def generated_text(payloads: list[bytes], kind: str) -> str:
    """The text of the content chunks relayed so far."""
    out = []
    for p in payloads:
        try:
            choice = orjson.loads(p)["choices"][0]
        except (orjson.JSONDecodeError, KeyError, IndexError, TypeError):
            continue
        part = (choice.get("delta") or {}).get("content") if kind == "chat" else \
            choice.get("text")
        if isinstance(part, str):
            out.append(part)
    return "".join(out)


def continuation(body: dict[str, Any], kind: str, text: str, generated: int,
                 encode: Callable[[str], list[int]]) -> dict[str, Any]:
    """The request that continues ``body`` after ``generated`` tokens whose text is ``text``."""
    nxt = dict(body)
    if kind == "chat":
        nxt["messages"] = [*body["messages"], {"role": "assistant", "content": text}]
        nxt["continue_final_message"] = True
        nxt["add_generation_prompt"] = False
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], list):
            prompt = prompt[0]
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            prompt = prompt[0]
        if isinstance(prompt, list):
            nxt["prompt"] = [*prompt, *encode(text)]
        else:
            nxt["prompt"] = str(prompt or "") + text
    for key in ("max_tokens", "max_completion_tokens"):
        if isinstance(body.get(key), int):
            nxt[key] = max(body[key] - generated, 1)
    if isinstance(body.get("min_tokens"), int):
        nxt["min_tokens"] = max(body["min_tokens"] - generated, 0)
    return nxt


def shift_usage(payload: bytes, generated: int) -> tuple[bytes, dict[str, Any] | None]:
    """A continuation's usage chunk, counted as the client's one request: its prompt included
    the ``generated`` tokens, which are completion tokens of the request as a whole."""
    try:
        obj = orjson.loads(payload)
    except orjson.JSONDecodeError:
        return payload, None
    u = obj.get("usage") if isinstance(obj, dict) else None
    if not isinstance(u, dict):
        return payload, None
    if isinstance(u.get("prompt_tokens"), int):
        u["prompt_tokens"] = max(u["prompt_tokens"] - generated, 0)
    if isinstance(u.get("completion_tokens"), int):
        u["completion_tokens"] += generated
    details = u.get("prompt_tokens_details")
    if isinstance(details, dict) and isinstance(details.get("cached_tokens"), int):
        details["cached_tokens"] = min(details["cached_tokens"], u.get("prompt_tokens", 0))
    return orjson.dumps(obj), u
