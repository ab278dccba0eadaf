"""A non-streamed answer built from the upstream's stream.

The gateway always asks the engine to stream, also for a client that did not ask for a stream:
it then sees every token as it is generated, charges long answers progressively, and knows
what the engine did when the client leaves before the answer is complete (the engine stops
when the gateway closes the stream; the tokens it made until then are charged). ``Aggregate``
is the relay's sink for such a request: it collects the events the relay passes (already
checked, the model already renamed) and builds the one JSON object OpenAI's API answers --
``chat.completion`` or ``text_completion`` -- from them: content, reasoning, tool calls merged
by index, logprobs, each choice's ``finish_reason``, and ``usage`` (the engine's, or the
gateway's own count when the engine sent none)."""

from __future__ import annotations

from typing import Any

import orjson

from gateway.request.relay import Collector

_EXTRA = ("system_fingerprint", "kv_transfer_params", "service_tier")


class Aggregate(Collector):
    """Collects a relayed stream's events (parsed and checked by the relay, which hands
    them over as objects: ``relay.Collector``) into one answer."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.head: dict[str, Any] = {}
        self.choices: dict[int, dict[str, Any]] = {}
        self.usage: dict[str, Any] | None = None

    def collect(self, obj: dict[str, Any]) -> None:
        for k in ("id", "created", "model", *_EXTRA):
            if obj.get(k) is None:
                continue
            if k in ("id", "created"):
                self.head.setdefault(k, obj[k])  # the first event's
            else:
                self.head[k] = obj[k]  # the last event's
        if isinstance(obj.get("usage"), dict):
            self.usage = obj["usage"]
        for c in obj.get("choices") or ():
            if not isinstance(c, dict):
                continue
            i = c.get("index", 0)
            i = i if isinstance(i, int) else 0
            slot = self.choices.setdefault(i, _slot())
            if c.get("finish_reason") is not None:
                slot["finish"] = c["finish_reason"]
            if "stop_reason" in c and c["stop_reason"] is not None:
                slot["stop_reason"] = c["stop_reason"]
            _merge_logprobs(slot, c.get("logprobs"))
            d = c.get("delta")
            if isinstance(d, dict):
                self._delta(slot, d)
            elif isinstance(c.get("text"), str):
                slot["text"].append(c["text"])

    @staticmethod
    def _delta(slot: dict[str, Any], d: dict[str, Any]) -> None:
        if isinstance(d.get("role"), str):
            slot["role"] = d["role"]
        if isinstance(d.get("content"), str):
            slot["text"].append(d["content"])
        for k in ("reasoning_content", "reasoning"):
            if isinstance(d.get(k), str):
                slot["reasoning"].append(d[k])
        for t in d.get("tool_calls") or ():
            if not isinstance(t, dict):
                continue
            j = t.get("index", 0)
            call = slot["tools"].setdefault(j if isinstance(j, int) else 0, {
                "id": None, "type": "function", "name": [], "arguments": []})
            if isinstance(t.get("id"), str):
                call["id"] = t["id"]
            if isinstance(t.get("type"), str):
                call["type"] = t["type"]
            fn = t.get("function")
            if isinstance(fn, dict):
                if isinstance(fn.get("name"), str):
                    call["name"].append(fn["name"])
                if isinstance(fn.get("arguments"), str):
                    call["arguments"].append(fn["arguments"])

    def body(self, *, usage: dict[str, Any]) -> bytes:
        """The answer as the client gets it, with ``usage`` (the engine's when it sent one)."""
        chat = self.kind == "chat"
        choices = []
        for i in sorted(self.choices) or [0]:
            slot = self.choices.get(i) or _slot()
            if chat:
                msg: dict[str, Any] = {"role": slot["role"],
                                       "content": "".join(slot["text"]) if slot["text"] or
                                       not slot["tools"] else None}
                if slot["reasoning"]:
                    msg["reasoning_content"] = "".join(slot["reasoning"])
                if slot["tools"]:
                    msg["tool_calls"] = [
                        {"id": c["id"], "type": c["type"], "function": {
                            "name": "".join(c["name"]), "arguments": "".join(c["arguments"])}}
                        for _, c in sorted(slot["tools"].items())]
                choice: dict[str, Any] = {"index": i, "message": msg}
            else:
                choice = {"index": i, "text": "".join(slot["text"])}
            choice["logprobs"] = slot["logprobs"]
            choice["finish_reason"] = slot["finish"]
            if slot["stop_reason"] is not None:
                choice["stop_reason"] = slot["stop_reason"]
            choices.append(choice)
        out: dict[str, Any] = {"id": self.head.get("id"),
                               "object": "chat.completion" if chat else "text_completion",
                               "created": self.head.get("created"),
                               "model": self.head.get("model"), "choices": choices,
                               "usage": self.usage or usage}
        for k in _EXTRA:
            if k in self.head:
                out[k] = self.head[k]
        return orjson.dumps(out)


def _slot() -> dict[str, Any]:
    return {"text": [], "reasoning": [], "tools": {}, "logprobs": None, "finish": None,
            "stop_reason": None, "role": "assistant"}


def _merge_logprobs(slot: dict[str, Any], lp: Any) -> None:
    """Chat logprobs (``{"content": [...]}``) and completion logprobs (parallel lists) are
    concatenated chunk by chunk."""
    if not isinstance(lp, dict):
        return
    have = slot["logprobs"]
    if have is None:
        slot["logprobs"] = {k: list(v) if isinstance(v, list) else v for k, v in lp.items()}
        return
    for k, v in lp.items():
        if isinstance(v, list) and isinstance(have.get(k), list):
            have[k].extend(v)
        elif k not in have:
            have[k] = v
