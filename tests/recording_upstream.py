"""A real OpenAI-compatible HTTP server on loopback that records every request it receives
(method, path, headers, body) and answers with fixed completions, streamed or not; its
responses carry internal headers a gateway must not pass on. For tests that must see exactly
what reached the upstream."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

import orjson
from aiohttp import web
from threaded import ServerThread, start_server_thread

INTERNAL_HEADERS = {"X-Internal-Host": "db-7.internal.example", "Server": "secret-engine/1.2"}


@dataclass
class Recorded:
    method: str
    path: str
    headers: dict[str, str]
    body: dict[str, Any]


@dataclass
class RecordingUpstream:
    requests: list[Recorded] = field(default_factory=list)
    server: ServerThread | None = None
    port: int = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        body = orjson.loads(await request.read() or b"{}")
        self.requests.append(Recorded(request.method, request.path, dict(request.headers),
                                      body))
        words = ["one", " two", " three"]
        chat = request.path.endswith("/chat/completions")
        if body.get("stream"):
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                               **INTERNAL_HEADERS})
            await resp.prepare(request)
            for w in words:
                delta = {"delta": {"content": w}} if chat else {"text": w}
                chunk = {"id": "x", "object": "chunk", "model": body.get("model"),
                         "choices": [{"index": 0, **delta, "finish_reason": None}]}
                await resp.write(b"data: " + orjson.dumps(chunk) + b"\n\n")
            usage = {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}
            await resp.write(b"data: " + orjson.dumps({"id": "x", "choices": [],
                                                       "model": body.get("model"),
                                                       "usage": usage}) + b"\n\n")
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
            return resp
        choice = ({"message": {"role": "assistant", "content": "".join(words)}} if chat
                  else {"text": "".join(words)})
        out = {"id": "x", "object": "chat.completion" if chat else "text_completion",
               "model": body.get("model"), "choices": [{"index": 0, **choice,
                                                        "finish_reason": "length"}],
               "usage": {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}}
        return web.json_response(out, headers=INTERNAL_HEADERS)

    async def _metrics(self, request: web.Request) -> web.Response:
        return web.Response(text="")

    def start(self) -> RecordingUpstream:
        async def serve(ready: asyncio.Event, stop: asyncio.Event) -> None:
            app = web.Application()
            app.router.add_post("/v1/chat/completions", self._handle)
            app.router.add_post("/v1/completions", self._handle)
            app.router.add_get("/metrics", self._metrics)
            app.router.add_get("/health", self._metrics)
            runner = web.AppRunner(app)
            await runner.setup()
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
            ready.set()
            await stop.wait()
            await runner.cleanup()

        self.server = start_server_thread(serve, "recording upstream")
        return self

    def close(self) -> None:
        if self.server is not None:
            self.server.close()
