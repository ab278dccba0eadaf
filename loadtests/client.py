"""One streamed OpenAI request, timed the way vLLM's ``bench serve`` times it."""

from __future__ import annotations

import asyncio
import itertools
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson


@dataclass(slots=True)
class RequestResult:
    """Client-side timings of one request (seconds, ``time.perf_counter`` based)."""

    sent_at: float
    ttft: float | None = None  # first chunk with content − send
    latency: float | None = None  # last chunk − send
    chunk_times: list[float] = field(default_factory=list)  # arrival of each content chunk
    output_tokens: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    endpoint: str | None = None
    prefill_endpoint: str | None = None  # where the prompt was computed, when not ``endpoint``
    text_parts: list[str] = field(default_factory=list)
    usage_reported: bool = False
    # http_<status>[:<code>], stream_error[:<code>], timeout, broken_stream, connect, cancelled
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def text(self) -> str:
        return "".join(self.text_parts)

    @property
    def itls(self) -> list[float]:
        t = self.chunk_times
        return [b - a for a, b in itertools.pairwise(t)]


async def wait_for(url: str, *, ok_below: int = 300, timeout_s: float = 60.0) -> None:
    """Poll ``url`` until it answers with a status below ``ok_below`` (any 2xx by default)."""
    deadline = time.monotonic() + timeout_s
    async with aiohttp.ClientSession() as s:
        while time.monotonic() < deadline:
            try:
                async with s.get(url) as r:
                    if r.status < ok_below:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.05)
    raise RuntimeError(f"{url} did not come up in {timeout_s:.0f}s")


def _error_code(body: bytes) -> str:
    """``:code`` from an OpenAI-shaped error body, or nothing."""
    try:
        err = orjson.loads(body).get("error")
    except (orjson.JSONDecodeError, AttributeError):
        return ""
    code = err.get("code") if isinstance(err, dict) else None
    return f":{code}" if isinstance(code, str) and code else ""


async def stream_request(session: aiohttp.ClientSession, url: str, body: dict[str, Any],
                         *, headers: dict[str, str] | None = None,
                         timeout_s: float = 600.0) -> RequestResult:
    """POST a streaming completion/chat request and time every content chunk."""
    res = RequestResult(sent_at=time.perf_counter())
    saw_done = False
    try:
        async with session.post(url, data=orjson.dumps(body), headers=headers,
                                timeout=aiohttp.ClientTimeout(total=timeout_s)) as r:
            res.endpoint = r.headers.get("x-tokengate-endpoint")
            res.prefill_endpoint = r.headers.get("x-tokengate-prefill-endpoint")
            if r.status != 200:
                res.error = f"http_{r.status}" + _error_code(await r.read())
                return res
            async for raw in r.content:
                if not raw.startswith(b"data:"):
                    continue
                now = time.perf_counter()
                payload = raw[5:].strip()
                if payload == b"[DONE]":
                    saw_done = True
                    break
                chunk = orjson.loads(payload)
                if "error" in chunk:
                    res.error = "stream_error" + _error_code(payload)
                    break
                usage = chunk.get("usage")
                if usage:
                    res.usage_reported = True
                    res.output_tokens = int(usage.get("completion_tokens") or 0)
                    res.prompt_tokens = int(usage.get("prompt_tokens") or 0)
                    details = usage.get("prompt_tokens_details") or {}
                    res.cached_tokens = int(details.get("cached_tokens") or 0)
                for ch in chunk.get("choices") or ():
                    text = ch.get("text")
                    if text is None:
                        text = (ch.get("delta") or {}).get("content")
                    if text:
                        res.text_parts.append(text)
                        if res.ttft is None:
                            res.ttft = now - res.sent_at
                        res.chunk_times.append(now)
        if res.error is None and not saw_done:
            res.error = "broken_stream"
    except TimeoutError:
        res.error = "timeout"
    except aiohttp.ClientPayloadError:
        res.error = "broken_stream"
    except aiohttp.ClientError:
        res.error = "connect"
    if res.chunk_times:
        res.latency = res.chunk_times[-1] - res.sent_at
    return res
