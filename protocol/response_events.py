"""The way back of OpenAI's Responses API served as chat completions (the way there is
``protocol.responses``): ``completion_to_response`` turns the chat completion into a
``response`` object; ``EventStream`` turns a chat completion's stream, chunk by chunk, into
the Responses event sequence (``response.created``, ``response.in_progress``,
``response.output_item.added``, ``response.content_part.added``,
``response.output_text.delta``, … ``response.completed`` with ``usage``, or
``response.failed``)."""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

import orjson


def usage_of(chat_usage: Mapping[str, Any] | None) -> dict[str, Any] | None:
    if not chat_usage:
        return None
    inp = int(chat_usage.get("prompt_tokens") or 0)
    out = int(chat_usage.get("completion_tokens") or 0)
    details = chat_usage.get("prompt_tokens_details") or {}
    cached = int(details.get("cached_tokens") or 0) if isinstance(details, Mapping) else 0
    out_details = chat_usage.get("completion_tokens_details") or {}
    reasoning = int(out_details.get("reasoning_tokens") or 0) \
        if isinstance(out_details, Mapping) else 0
    return {"input_tokens": inp, "input_tokens_details": {"cached_tokens": cached},
            "output_tokens": out, "output_tokens_details": {"reasoning_tokens": reasoning},
            "total_tokens": inp + out}


class Shape:
    """What a response object repeats of its request, and its identity."""

    def __init__(self, request: Mapping[str, Any], response_id: str) -> None:
        self.id = response_id if response_id.startswith("resp_") else f"resp_{response_id}"
        self.created_at = int(time.time())
        self.request = request

    def response(self, model: str, status: str, output: list[dict[str, Any]],
                 usage: dict[str, Any] | None, *, incomplete: str | None = None,
                 error: dict[str, Any] | None = None) -> dict[str, Any]:
        r = self.request
        text = r.get("text") if isinstance(r.get("text"), Mapping) else None
        return {
            "id": self.id, "object": "response", "created_at": self.created_at,
            "status": status, "background": False, "error": error,
            "incomplete_details": {"reason": incomplete} if incomplete else None,
            "instructions": r.get("instructions"),
            "max_output_tokens": r.get("max_output_tokens"), "model": model,
            "output": output, "parallel_tool_calls": r.get("parallel_tool_calls", True),
            "previous_response_id": None, "reasoning": {"effort": None, "summary": None},
            "store": False, "temperature": r.get("temperature", 1.0),
            "text": text or {"format": {"type": "text"}},
            "tool_choice": r.get("tool_choice", "auto"), "tools": r.get("tools") or [],
            "top_p": r.get("top_p", 1.0), "truncation": "disabled", "usage": usage,
            "user": r.get("user"), "metadata": r.get("metadata") or {}}


def _message(item_id: str, text: str, status: str) -> dict[str, Any]:
    return {"type": "message", "id": item_id, "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [],
                         "logprobs": []}] if status == "completed" or text else []}


def _call(item_id: str, call_id: str, name: str, args: str, status: str) -> dict[str, Any]:
    return {"type": "function_call", "id": item_id, "call_id": call_id, "name": name,
            "arguments": args, "status": status}


def _reasoning(item_id: str, text: str) -> dict[str, Any]:
    return {"type": "reasoning", "id": item_id, "summary": [],
            "content": [{"type": "reasoning_text", "text": text}]}


def _incomplete(finish: Any) -> str | None:
    return "max_output_tokens" if finish == "length" else None


def completion_to_response(shape: Shape, completion: Mapping[str, Any]) -> dict[str, Any]:
    """The ``response`` object for a whole chat completion."""
    choice = (completion.get("choices") or [{}])[0]
    msg = choice.get("message") or {}
    output: list[dict[str, Any]] = []
    reasoning = msg.get("reasoning_content") or msg.get("reasoning")
    if reasoning:
        output.append(_reasoning(f"rs_{shape.id[5:]}", reasoning))
    if msg.get("content"):
        output.append(_message(f"msg_{shape.id[5:]}", msg["content"], "completed"))
    for n, call in enumerate(msg.get("tool_calls") or ()):
        fn = call.get("function") or {}
        output.append(_call(f"fc_{shape.id[5:]}_{n}", call.get("id") or f"call_{n}",
                            fn.get("name") or "", fn.get("arguments") or "", "completed"))
    incomplete = _incomplete(choice.get("finish_reason"))
    return shape.response(str(completion.get("model") or shape.request.get("model")),
                          "incomplete" if incomplete else "completed", output,
                          usage_of(completion.get("usage")), incomplete=incomplete)


class EventStream:
    """A chat completion's stream, chunk by chunk, as the Responses event sequence."""

    def __init__(self, shape: Shape, model: str) -> None:
        self.shape = shape
        self.model = model
        self.seq = 0
        self.started = False
        self.ended = False
        self.items: list[dict[str, Any]] = []  # output items, in order, as they stand
        self.open: dict[str, Any] | None = None  # the item text or arguments go to now
        self.calls: dict[int, dict[str, Any]] = {}  # tool-call index -> its item
        self.finish: Any = None
        self.usage: dict[str, Any] | None = None

    def _event(self, kind: str, **fields: Any) -> bytes:
        data = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps(data) + b"\n\n"

    def _start(self) -> list[bytes]:
        if self.started:
            return []
        self.started = True
        r = self.shape.response(self.model, "in_progress", [], None)
        return [self._event("response.created", response=r),
                self._event("response.in_progress", response=r)]

    def chunk(self, obj: Mapping[str, Any]) -> list[bytes]:
        """Events for one chat chunk."""
        out = self._start()
        if isinstance(obj.get("usage"), Mapping):
            self.usage = dict(obj["usage"])
        for c in obj.get("choices") or ():
            if not isinstance(c, Mapping) or c.get("index", 0) != 0:
                continue
            d = c.get("delta") or {}
            reasoning = d.get("reasoning_content") or d.get("reasoning")
            if isinstance(reasoning, str) and reasoning:
                out += self._text("reasoning", reasoning)
            if isinstance(d.get("content"), str) and d["content"]:
                out += self._text("message", d["content"])
            for t in d.get("tool_calls") or ():
                if isinstance(t, Mapping):
                    out += self._tool(t)
            if c.get("finish_reason") is not None:
                self.finish = c["finish_reason"]
        return out

    def _text(self, kind: str, delta: str) -> list[bytes]:
        out: list[bytes] = []
        item = self.open
        if item is None or item["type"] != kind:
            out += self._close()
            n = len(self.items)
            if kind == "message":
                item = _message(f"msg_{self.shape.id[5:]}_{n}", "", "in_progress")
            else:
                item = _reasoning(f"rs_{self.shape.id[5:]}_{n}", "")
                item["content"] = []
            item["_text"] = []
            self.items.append(item)
            self.open = item
            out.append(self._event("response.output_item.added", output_index=n,
                                   item=_public(item)))
            if kind == "message":
                out.append(self._event("response.content_part.added", item_id=item["id"],
                                       output_index=n, content_index=0, part={
                                           "type": "output_text", "text": "",
                                           "annotations": [], "logprobs": []}))
        item["_text"].append(delta)
        n = self.items.index(item)
        if kind == "message":
            out.append(self._event("response.output_text.delta", item_id=item["id"],
                                   output_index=n, content_index=0, delta=delta,
                                   logprobs=[]))
        else:
            out.append(self._event("response.reasoning_text.delta", item_id=item["id"],
                                   output_index=n, content_index=0, delta=delta))
        return out

    def _tool(self, t: Mapping[str, Any]) -> list[bytes]:
        out: list[bytes] = []
        j = t.get("index", 0)
        fn = t.get("function") or {}
        item = self.calls.get(j)
        if item is None:
            out += self._close()
            n = len(self.items)
            item = _call(f"fc_{self.shape.id[5:]}_{n}", str(t.get("id") or f"call_{j}"),
                         str(fn.get("name") or ""), "", "in_progress")
            item["_text"] = []
            self.calls[j] = item
            self.items.append(item)
            self.open = item
            out.append(self._event("response.output_item.added", output_index=n,
                                   item=_public(item)))
        elif isinstance(fn.get("name"), str) and fn["name"] and not item["name"]:
            item["name"] = fn["name"]
        args = fn.get("arguments")
        if isinstance(args, str) and args:
            item["_text"].append(args)
            out.append(self._event("response.function_call_arguments.delta",
                                   item_id=item["id"], output_index=self.items.index(item),
                                   delta=args))
        return out

    def _close(self) -> list[bytes]:
        item, self.open = self.open, None
        if item is None:
            return []
        n = self.items.index(item)
        text = "".join(item["_text"])
        out: list[bytes] = []
        if item["type"] == "message":
            item["status"] = "completed"
            part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
            item["content"] = [part]
            out += [self._event("response.output_text.done", item_id=item["id"],
                                output_index=n, content_index=0, text=text, logprobs=[]),
                    self._event("response.content_part.done", item_id=item["id"],
                                output_index=n, content_index=0, part=part)]
        elif item["type"] == "function_call":
            item["status"] = "completed"
            item["arguments"] = text
            out.append(self._event("response.function_call_arguments.done",
                                   item_id=item["id"], output_index=n, arguments=text))
        else:
            item["content"] = [{"type": "reasoning_text", "text": text}]
            out.append(self._event("response.reasoning_text.done", item_id=item["id"],
                                   output_index=n, content_index=0, text=text))
        out.append(self._event("response.output_item.done", output_index=n,
                               item=_public(item)))
        return out

    def done(self, fallback_usage: Mapping[str, Any]) -> list[bytes]:
        """The closing events: every open item done, then ``response.completed`` (or
        ``response.incomplete`` when ``max_output_tokens`` cut it) with ``usage`` (the
        engine's, else ``fallback_usage``)."""
        if self.ended:
            return []
        out = self._start()
        while self.open is not None or any(i.get("status") == "in_progress"
                                           for i in self.items):
            if self.open is None:
                self.open = next(i for i in self.items if i.get("status") == "in_progress")
            out += self._close()
        self.ended = True
        incomplete = _incomplete(self.finish)
        r = self.shape.response(self.model, "incomplete" if incomplete else "completed",
                                [_public(i) for i in self.items],
                                usage_of(self.usage or fallback_usage), incomplete=incomplete)
        kind = "response.incomplete" if incomplete else "response.completed"
        return [*out, self._event(kind, response=r)]

    def failed(self, error: Mapping[str, Any]) -> list[bytes]:
        """The stream broke: ``response.failed`` with the gateway's error (code, message)."""
        if self.ended:
            return []
        out = self._start()
        self.ended = True
        r = self.shape.response(self.model, "failed", [_public(i) for i in self.items], None,
                                error={"code": error.get("code") or "server_error",
                                       "message": error.get("message") or "upstream error"})
        return [*out, self._event("response.failed", response=r)]


def _public(item: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in item.items() if not k.startswith("_")}
