"""OpenAI request parsing and validation for the reference backend (pure functions).

Bodies are validated the way vLLM's OpenAI server does it: wrong types and out-of-range values
are 400s naming the parameter, an unknown model is a 404, unknown fields are accepted and
ignored (routers add their own, e.g. SGLang's ``no_stop_trim``). Errors use OpenAI's shape.
"""

from __future__ import annotations

import binascii
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import orjson

from protocol.errors import bad

Kind = Literal["chat", "completion"]
MAX_TOKEN_ID = 2**31  # ids index a vocabulary; past this they cannot be one
_ROLES = frozenset({"system", "developer", "user", "assistant", "tool", "function"})


@dataclass(slots=True)
class GenerationRequest:
    """A validated request, before tokenization."""

    kind: Kind
    model: str
    messages: list[dict[str, Any]] = field(default_factory=list)
    prompt_text: str | None = None
    prompt_ids: Sequence[int] | None = None
    stream: bool = False
    include_usage: bool = False
    max_tokens: int | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop: tuple[str, ...] = ()
    seed: int | None = None
    cache_salt: str | None = None
    kv_transfer_params: dict[str, Any] | None = None
    continue_final: bool = False  # chat: extend the final assistant message (vLLM's option)
    priority: int = 0  # vLLM's: lower is scheduled first under --scheduling-policy priority
    n: int = 1  # choices asked for (each up to max_tokens)
    images: Images = field(default_factory=lambda: Images())  # image parts in the messages


def _opt_int(body: Mapping[str, Any], key: str, lo: int, hi: int) -> int | None:
    v = body.get(key)
    if v is None:
        return None
    if isinstance(v, float) and v.is_integer():
        v = int(v)  # 16.0 is accepted as 16, as vLLM's (pydantic's lax) parsing does
    if isinstance(v, bool) or not isinstance(v, int):
        raise bad(f"'{key}' must be an integer, got {type(v).__name__}", key)
    if not lo <= v <= hi:
        raise bad(f"'{key}' must be between {lo} and {hi}, got {v}", key)
    return v


def _opt_number(body: Mapping[str, Any], key: str, lo: float, hi: float) -> None:
    v = body.get(key)
    if v is None:
        return
    if isinstance(v, bool) or not isinstance(v, int | float):
        raise bad(f"'{key}' must be a number, got {type(v).__name__}", key)
    if not lo <= v <= hi:
        raise bad(f"'{key}' must be between {lo} and {hi}, got {v}", key)


def _opt_bool(body: Mapping[str, Any], key: str) -> bool:
    v = body.get(key)
    if v is None:
        return False
    if not isinstance(v, bool):
        raise bad(f"'{key}' must be a boolean, got {type(v).__name__}", key)
    return v


_IMAGE_HEAD = re.compile(r"data:image/(png|jpeg|jpg|gif|webp);base64,")
MAX_IMAGE_BYTES = 20 * 1024 * 1024  # decoded, per image (OpenAI's limit)


def _data_image(url: str) -> bool:
    """A base64 data URL of a png, jpeg, gif or webp image: strict base64 all through
    (alphabet, padding, no whitespace), at most ``MAX_IMAGE_BYTES`` decoded."""
    head = _IMAGE_HEAD.match(url)
    if head is None:
        return False
    data = url[head.end():]
    if not data or len(data) % 4 or len(data) // 4 * 3 > MAX_IMAGE_BYTES + 2:
        return False
    try:
        binascii.a2b_base64(data, strict_mode=True)
    except (binascii.Error, ValueError):
        return False
    return True


@dataclass(slots=True)
class Images:
    """The images a chat request's messages carry (``image_url`` content parts)."""

    count: int = 0
    first: str | None = None  # the parameter path of the first
    remote: str | None = None  # the path of the first given by http(s) URL (the engine fetches)


def _text_content(content: Any, param: str, images: Images) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list):
        parts: list[str] = []
        for i, part in enumerate(content):
            p = f"{param}[{i}]"
            if isinstance(part, Mapping) and part.get("type") == "image_url":
                _image(part.get("image_url"), p, images)
                continue
            if not isinstance(part, Mapping) or part.get("type") != "text" \
                    or not isinstance(part.get("text"), str):
                raise bad(f"{p}: content parts are text or image_url", p)
            parts.append(part["text"])
        return "\n".join(parts)
    raise bad(f"{param} must be a string or a list of content parts", param)


def _image(raw: Any, p: str, images: Images) -> None:
    url = raw.get("url") if isinstance(raw, Mapping) else None
    if not isinstance(url, str):
        raise bad(f"{p}.image_url.url must be a string", f"{p}.image_url.url")
    if url.startswith(("http://", "https://")):
        images.remote = images.remote or p
    elif not _data_image(url):
        raise bad(f"{p}.image_url.url must be a base64 data URL of a png, jpeg, gif or webp "
                  f"image (at most {MAX_IMAGE_BYTES // 2**20} MiB), or an http(s) URL",
                  f"{p}.image_url.url")
    images.count += 1
    images.first = images.first or p


def _messages(raw: Any, images: Images) -> list[dict[str, Any]]:
    if not isinstance(raw, list) or not raw:
        raise bad("'messages' must be a non-empty array", "messages")
    out: list[dict[str, Any]] = []
    for i, m in enumerate(raw):
        p = f"messages[{i}]"
        if not isinstance(m, Mapping):
            raise bad(f"{p} must be an object", p)
        role = m.get("role")
        if not isinstance(role, str) or role not in _ROLES:
            raise bad(f"{p}.role must be one of {sorted(_ROLES)}", f"{p}.role")
        content = _text_content(m.get("content"), f"{p}.content", images)
        calls = m.get("tool_calls")
        if calls is not None:
            if not isinstance(calls, list):
                raise bad(f"{p}.tool_calls must be an array", f"{p}.tool_calls")
            content += "".join(orjson.dumps(c).decode() for c in calls)
        for key in ("reasoning", "reasoning_content"):  # an earlier turn's reasoning, sent on
            text = m.get(key)
            if text is not None:
                if not isinstance(text, str):
                    raise bad(f"{p}.{key} must be a string", f"{p}.{key}")
                content += text
        legacy = m.get("function_call")
        if legacy is not None:
            content += orjson.dumps(legacy).decode()
        msg: dict[str, Any] = {"role": role, "content": content}
        name = m.get("name")
        if name is not None:
            if not isinstance(name, str):
                raise bad(f"{p}.name must be a string", f"{p}.name")
            msg["name"] = name
        out.append(msg)
    return out


def definitions(body: Mapping[str, Any]) -> str | None:
    """What a chat request defines besides its messages -- ``tools``, the legacy
    ``functions``, a ``response_format`` other than text -- as compact JSON, or None.

    Under OpenAI's accounting (the marker template: no Jinja template to render tools with)
    this is the prompt's first entry, a system message, so it is counted, reserved and
    cached like any prefix; the reference backend builds its prompt from the same messages.
    A model's own template renders ``tools`` itself (and, as in vLLM, ``response_format``
    constrains decoding without entering the prompt)."""
    out: dict[str, Any] = {}
    for key, kind in (("tools", list), ("functions", list), ("response_format", Mapping)):
        v = body.get(key)
        if v is None:
            continue
        if not isinstance(v, kind):
            raise bad(f"'{key}' must be an {'array' if kind is list else 'object'}", key)
        if isinstance(v, Mapping) and v.get("type") in (None, "text"):
            continue
        if v:
            out[key] = v
    return orjson.dumps(out).decode() if out else None


def _prompt(raw: Any) -> tuple[str | None, list[int] | None]:
    if isinstance(raw, list) and len(raw) == 1 and isinstance(raw[0], str | list):
        raw = raw[0]  # a batch of one
    if isinstance(raw, str):
        if not raw:
            raise bad("'prompt' must not be empty", "prompt")
        return raw, None
    if isinstance(raw, list) and raw and all(
            isinstance(t, int | float) and not isinstance(t, bool) for t in raw):
        if not all(isinstance(t, int) or t.is_integer() for t in raw):
            raise bad("'prompt' token ids must be integers", "prompt")
        ids = [int(t) for t in raw]
        if any(not 0 <= t < MAX_TOKEN_ID for t in ids):
            raise bad(f"'prompt' token ids must be within [0, {MAX_TOKEN_ID})", "prompt")
        return None, ids
    if isinstance(raw, list) and len(raw) > 1:
        raise bad("batched prompts are not supported; send one prompt per request", "prompt")
    raise bad("'prompt' must be a string or an array of token ids", "prompt")


def parse(kind: Kind, raw_body: bytes) -> GenerationRequest:
    """Parse and validate a ``/v1/chat/completions`` or ``/v1/completions`` body."""
    return validate(kind, load_json(raw_body))


def load_json(raw_body: bytes) -> Any:
    try:
        return orjson.loads(raw_body)
    except orjson.JSONDecodeError as exc:
        raise bad(f"request body is not valid JSON: {exc}") from None


def validate(kind: Kind, body: Any) -> GenerationRequest:
    """Validate an already decoded body."""
    if not isinstance(body, dict):
        raise bad("request body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad("'model' is required and must be a string", "model")
    req = GenerationRequest(kind=kind, model=model)
    if kind == "chat":
        req.messages = _messages(body.get("messages"), req.images)
        defs = definitions(body)
        if defs is not None:
            req.messages.insert(0, {"role": "system", "content": defs})
    else:
        req.prompt_text, req.prompt_ids = _prompt(body.get("prompt"))
        if _opt_bool(body, "echo"):
            raise bad("'echo' is not supported", "echo")
    req.stream = _opt_bool(body, "stream")
    opts = body.get("stream_options")
    if opts is not None:
        if not isinstance(opts, Mapping):
            raise bad("'stream_options' must be an object", "stream_options")
        if not req.stream:
            raise bad("'stream_options' is only allowed when 'stream' is true", "stream_options")
        req.include_usage = _opt_bool(opts, "include_usage")
    mt = _opt_int(body, "max_completion_tokens", 1, 2**31 - 1)
    if mt is None:
        mt = _opt_int(body, "max_tokens", 1, 2**31 - 1)
    req.max_tokens = mt
    req.min_tokens = _opt_int(body, "min_tokens", 0, 2**31 - 1) or 0
    req.ignore_eos = _opt_bool(body, "ignore_eos")
    req.priority = _opt_int(body, "priority", -(2**31), 2**31 - 1) or 0
    req.n = _opt_int(body, "n", 1, 128) or 1
    req.seed = _opt_int(body, "seed", -(2**63), 2**64 - 1)
    _opt_number(body, "temperature", 0.0, 2.0)
    _opt_number(body, "top_p", 0.0, 1.0)
    _opt_number(body, "presence_penalty", -2.0, 2.0)
    _opt_number(body, "frequency_penalty", -2.0, 2.0)
    stop = body.get("stop")
    if isinstance(stop, str):
        req.stop = (stop,) if stop else ()
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        if len(stop) > 4:
            raise bad("'stop' takes at most 4 sequences", "stop")
        req.stop = tuple(s for s in stop if s)
    elif stop is not None:
        raise bad("'stop' must be a string or an array of strings", "stop")
    salt = body.get("cache_salt")
    if salt is not None:
        if not isinstance(salt, str) or not salt:
            raise bad("'cache_salt' must be a non-empty string", "cache_salt")
        req.cache_salt = salt
    kvp = body.get("kv_transfer_params")
    if kvp is not None:
        if not isinstance(kvp, dict):
            raise bad("'kv_transfer_params' must be an object", "kv_transfer_params")
        req.kv_transfer_params = kvp
    if kind == "chat" and _opt_bool(body, "continue_final_message"):
        if req.messages[-1]["role"] != "assistant":
            raise bad("'continue_final_message' needs the last message to be the "
                      "assistant's", "continue_final_message")
        req.continue_final = True
    return req
