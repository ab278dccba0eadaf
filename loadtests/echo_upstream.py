"""A minimal OpenAI-compatible upstream that answers at once (for measuring gateway overhead).

    python -m loadtests.echo_upstream --port 9000

Chat, completions and embeddings (four numbers per input), streaming (``--chunks`` content
chunks, then usage and ``[DONE]``) and not; usage counts the words it sends. TCP_NODELAY is
on (aiohttp's default).
"""

from __future__ import annotations

import argparse
import time

import orjson
from aiohttp import web


def build(chunks: int) -> web.Application:
    async def handle(request: web.Request) -> web.StreamResponse:
        body = orjson.loads(await request.read())
        chat = request.path.endswith("chat/completions")
        model = body.get("model", "echo")
        # Token-id prompts are counted exactly; otherwise a nominal 10. With ignore_eos the
        # answer is max_tokens words long, so usage matches what a gateway reserved.
        prompt = body.get("prompt")
        n_prompt = len(prompt) if isinstance(prompt, list) else 10
        n_out = int(body.get("max_tokens") or chunks) if body.get("ignore_eos") else chunks
        words = [" hello"] * n_out
        usage = {"prompt_tokens": n_prompt, "completion_tokens": n_out,
                 "total_tokens": n_prompt + n_out}
        rid = request.headers.get("X-Request-Id", "x")
        if not body.get("stream"):
            choice = ({"index": 0, "message": {"role": "assistant", "content": "".join(words)},
                       "finish_reason": "length"} if chat else
                      {"index": 0, "text": "".join(words), "finish_reason": "length"})
            return web.Response(body=orjson.dumps({
                "id": rid, "object": "chat.completion" if chat else "text_completion",
                "created": int(time.time()), "model": model, "choices": [choice],
                "usage": usage}), content_type="application/json")
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        obj = "chat.completion.chunk" if chat else "text_completion"
        for i, w in enumerate(words):
            choice = ({"index": 0, "delta": {"content": w}} if chat else {"index": 0, "text": w})
            choice["finish_reason"] = "length" if i == n_out - 1 else None
            await resp.write(b"data: " + orjson.dumps({"id": rid, "object": obj,
                                                        "model": model, "choices": [choice]})
                             + b"\n\n")
        if (body.get("stream_options") or {}).get("include_usage"):
            await resp.write(b"data: " + orjson.dumps({"id": rid, "object": obj, "model": model,
                                                        "choices": [], "usage": usage})
                             + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        return resp

    async def embeddings(request: web.Request) -> web.Response:
        body = orjson.loads(await request.read())
        inputs = body.get("input")
        items = inputs if isinstance(inputs, list) and not (
            inputs and isinstance(inputs[0], int)) else [inputs]
        n = sum(len(x) if isinstance(x, list) else 1 for x in items)
        return web.Response(body=orjson.dumps({
            "object": "list", "model": body.get("model", "echo"),
            "data": [{"object": "embedding", "index": i, "embedding": [0.5, -0.5, 0.25, 0.0]}
                     for i in range(len(items))],
            "usage": {"prompt_tokens": n, "total_tokens": n}}),
            content_type="application/json")

    async def health(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [
            {"id": "m", "object": "model", "created": 0, "owned_by": "echo"}]})

    app = web.Application(client_max_size=64 * 1024 * 1024)
    app.router.add_post("/v1/chat/completions", handle)
    app.router.add_post("/v1/completions", handle)
    app.router.add_post("/v1/embeddings", embeddings)
    # what routers probe before they send traffic (sglang-router and vllm-router: /health)
    app.router.add_get("/health", health)
    app.router.add_get("/v1/models", models)
    return app


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--chunks", type=int, default=8)
    a = p.parse_args()
    try:
        import uvloop

        uvloop.install()
    except ImportError:  # pragma: no cover
        pass
    web.run_app(build(a.chunks), host="127.0.0.1", port=a.port, access_log=None,
                print=None)


if __name__ == "__main__":
    main()
