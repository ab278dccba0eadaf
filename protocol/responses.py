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

The way back, a chat completion or its stream as a ``response`` object or the Responses
events, is ``protocol.response_events``."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

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
