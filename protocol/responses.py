"""OpenAI's Responses API (``POST /v1/responses``), stateless, as a translation to and from
chat completions.

``to_chat`` turns a Responses request into the chat request the engine is sent: the
``instructions`` become the first system message, ``input`` (a string, or a list of message,
``function_call`` and ``function_call_output`` items) the messages, ``tools`` chat tools,
``max_output_tokens`` ``max_tokens``, ``text.format`` ``response_format``. The prompt is then
counted over these very messages and tools with the model's chat template, which is what the
engine renders. Anything that needs state kept by the server (``previous_response_id``,
``store: true``, ``conversation``, ``background``) or a tool the gateway does not run (web
search, file search, MCP, …) is a 400 that says so.

``completion_to_response`` turns the chat completion back into a ``response`` object;
``EventStream`` turns a chat completion's stream, chunk by chunk, into the Responses event
sequence (``response.created``, ``response.in_progress``, ``response.output_item.added``,
``response.content_part.added``, ``response.output_text.delta``, … ``response.completed``
with ``usage``, or ``response.failed``)."""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

import orjson

from protocol.errors import bad

# Keys read or checked below; any other key is refused, as OpenAI refuses unknown parameters.
_PASSED = ("temperature", "top_p", "user", "parallel_tool_calls", "seed", "stop")
_ACCEPTED = frozenset({
    "model", "input", "instructions", "max_output_tokens", "tools", "tool_choice", "stream",
    "store", "previous_response_id", "conversation", "background", "text", "metadata",
    "include", "reasoning", "service_tier", "truncation", "safety_identifier",
    "prompt_cache_key", "stream_options", "top_logprobs", *_PASSED})
_STATEFUL = "this gateway serves the Responses API statelessly: "
_ROLES = frozenset({"user", "assistant", "system", "developer"})


def to_chat(body: Mapping[str, Any]) -> dict[str, Any]:
    """The chat request a Responses request becomes (400 in OpenAI's shape when it cannot)."""
    unknown = sorted(k for k in body if k not in _ACCEPTED)
    if unknown:
        raise bad(f"Unknown parameter: '{unknown[0]}'.", unknown[0], code="unknown_parameter")
    if body.get("previous_response_id") is not None:
        raise bad(_STATEFUL + "previous_response_id needs a stored response; send the whole "
                  "conversation in input instead", "previous_response_id")
    if body.get("store") is True:
        raise bad(_STATEFUL + "store: true is not supported (responses are not kept); send "
                  "store: false", "store")
    if body.get("conversation") is not None:
        raise bad(_STATEFUL + "conversation needs stored state; send the items in input",
                  "conversation")
    if body.get("background") is True:
        raise bad(_STATEFUL + "background responses are not supported", "background")
    if body.get("truncation") not in (None, "disabled"):
        raise bad("only truncation 'disabled' is supported", "truncation")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad("model must be a non-empty string", "model")
    messages: list[dict[str, Any]] = []
    instructions = body.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise bad("instructions must be a string", "instructions")
        if instructions:  # an empty one adds no message (as vLLM's own Responses API)
            messages.append({"role": "system", "content": instructions})
    messages.extend(_input_messages(body.get("input")))
    if body.get("stream") is not None and not isinstance(body["stream"], bool):
        raise bad("stream must be a boolean", "stream")
    limit = body.get("max_output_tokens")
    if isinstance(limit, float) and limit.is_integer():
        limit = int(limit)  # 16.0 is 16, as JSON numbers go
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int)
                              or not 1 <= limit < 2**31):
        raise bad("max_output_tokens must be a positive integer", "max_output_tokens")
    chat: dict[str, Any] = {"model": model, "messages": messages}
    if body.get("stream"):  # the usage comes last, for response.completed
        chat.update(stream=True, stream_options={"include_usage": True})
    if limit is not None:
        chat["max_tokens"] = limit
    for k in _PASSED:
        if body.get(k) is not None:
            chat[k] = body[k]
    tools = body.get("tools")
    if tools is not None:
        if not isinstance(tools, list):
            raise bad("tools must be a list", "tools")
        if tools:
            chat["tools"] = [_tool(t, i) for i, t in enumerate(tools)]
    if body.get("tool_choice") is not None:
        chat["tool_choice"] = _tool_choice(body["tool_choice"])
    fmt = _format(body.get("text"))
    if fmt is not None:
        chat["response_format"] = fmt
    return chat


def _input_messages(raw: Any) -> list[dict[str, Any]]:
    if isinstance(raw, str):
        return [{"role": "user", "content": raw}]
    if not isinstance(raw, list) or not raw:
        raise bad("input must be a string or a non-empty list of items", "input")
    out: list[dict[str, Any]] = []
    for i, item in enumerate(raw):
        p = f"input[{i}]"
        if not isinstance(item, Mapping):
            raise bad(f"{p} must be an object", p)
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if not isinstance(role, str) or role not in _ROLES:
                raise bad(f"{p}.role must be one of user, assistant, system, developer",
                          f"{p}.role")
            out.append({"role": role, "content": _content(item.get("content"), p, role)})
        elif kind == "function_call":
            call = {"id": _str(item, "call_id", p), "type": "function", "function": {
                "name": _str(item, "name", p), "arguments": _str(item, "arguments", p)}}
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant" and "tool_calls" in last:
                last["tool_calls"].append(call)  # parallel calls: one assistant turn
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            if isinstance(output, list):
                output = _text_of(output, f"{p}.output")
            if not isinstance(output, str):
                raise bad(f"{p}.output must be a string", f"{p}.output")
            out.append({"role": "tool", "tool_call_id": _str(item, "call_id", p),
                        "content": output})
        elif kind == "reasoning":
            # a model's own reasoning from an earlier turn: on the assistant turn it belongs
            # to (as vLLM's own Responses API passes it to the chat template)
            text = _reasoning_text(item, p)
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant" and "reasoning" not in last:
                last["reasoning"] = text
            else:
                out.append({"role": "assistant", "reasoning": text})
        else:
            raise bad(f"{p}.type {kind!r} is not supported (message, function_call, "
                      "function_call_output, reasoning)", f"{p}.type")
    return out


def _content(raw: Any, p: str, role: str) -> Any:
    if isinstance(raw, str):
        return raw
    if not isinstance(raw, list):
        raise bad(f"{p}.content must be a string or a list of parts", f"{p}.content")
    parts: list[dict[str, Any]] = []
    for j, part in enumerate(raw):
        q = f"{p}.content[{j}]"
        kind = part.get("type") if isinstance(part, Mapping) else None
        if kind in ("input_text", "output_text", "text", "reasoning_text", "summary_text"):
            text = part.get("text")
            if not isinstance(text, str):
                raise bad(f"{q}.text must be a string", f"{q}.text")
            parts.append({"type": "text", "text": text})
        elif kind == "input_image":
            url = part.get("image_url")
            if not isinstance(url, str):
                raise bad(f"{q}.image_url must be a URL or a data URL (file_id needs stored "
                          "files)", f"{q}.image_url")
            image: dict[str, Any] = {"url": url}
            if part.get("detail") is not None:
                image["detail"] = part["detail"]
            parts.append({"type": "image_url", "image_url": image})
        elif kind == "refusal" and role == "assistant":
            parts.append({"type": "text", "text": str(part.get("refusal", ""))})
        else:
            raise bad(f"{q}.type {kind!r} is not supported (input_text, input_image)",
                      f"{q}.type")
    return parts  # text parts are joined as the chat path joins them (as vLLM does)


def _reasoning_text(item: Mapping[str, Any], p: str) -> str:
    if item.get("encrypted_content"):
        raise bad(f"{p}.encrypted_content: encrypted reasoning cannot be read by this "
                  "model", f"{p}.encrypted_content")
    for key in ("content", "summary"):
        parts = item.get(key)
        if isinstance(parts, list) and parts:
            return _text_of(parts[:1], f"{p}.{key}")
    return ""


def _text_of(parts: list[Any], p: str) -> str:
    texts = [x.get("text") for x in parts if isinstance(x, Mapping) and x.get("type") in (
        "input_text", "output_text", "text", "reasoning_text", "summary_text")]
    if len(texts) != len(parts) or not all(isinstance(t, str) for t in texts):
        raise bad(f"{p} must be a string or a list of text parts", p)
    return "".join(texts)  # type: ignore[arg-type]


def _str(item: Mapping[str, Any], key: str, p: str) -> str:
    v = item.get(key)
    if not isinstance(v, str):
        raise bad(f"{p}.{key} must be a string", f"{p}.{key}")
    return v


def _tool(t: Any, i: int) -> dict[str, Any]:
    p = f"tools[{i}]"
    if not isinstance(t, Mapping):
        raise bad(f"{p} must be an object", p)
    if t.get("type") != "function":
        raise bad(f"{p}.type {t.get('type')!r} is not supported: this gateway forwards "
                  "function tools only (built-in tools such as web or file search need "
                  "OpenAI's servers)", f"{p}.type")
    fn: dict[str, Any] = {"name": _str(t, "name", p)}
    for k in ("description", "parameters", "strict"):
        if t.get(k) is not None:
            fn[k] = t[k]
    return {"type": "function", "function": fn}


def _tool_choice(raw: Any) -> Any:
    if raw in ("auto", "none", "required"):
        return raw
    if isinstance(raw, Mapping) and raw.get("type") == "function" \
            and isinstance(raw.get("name"), str):
        return {"type": "function", "function": {"name": raw["name"]}}
    raise bad("tool_choice must be auto, none, required or {type: function, name}",
              "tool_choice")


def _format(text: Any) -> dict[str, Any] | None:
    if text is None:
        return None
    fmt = text.get("format") if isinstance(text, Mapping) else None
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, Mapping) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema" and isinstance(fmt, Mapping):
        schema = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
        return {"type": "json_schema", "json_schema": schema}
    raise bad("text.format.type must be text, json_object or json_schema", "text.format.type")


# -- back: the response object and its events ----------------------------------------------


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
