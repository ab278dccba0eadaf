"""vLLM's runtime LoRA endpoints on the reference backend (``backend.lora`` says what they do);
registered only when ``VLLM_ALLOW_RUNTIME_LORA_UPDATING`` is true, as vLLM registers them."""

from __future__ import annotations

import asyncio

from aiohttp import web

from backend.state import STATE
from protocol.bodies import json_object
from protocol.errors import APIError

DISK_BANDWIDTH = 6e9  # bytes/s: an adapter is read from local disk (roofline.switching's)


def _field(body: dict[str, object], key: str) -> str:
    value = body.get(key)
    return value if isinstance(value, str) else ""


async def load(request: web.Request) -> web.Response:
    state = request.app[STATE]
    if state.lora is None:
        raise APIError(400, "LoRA is not enabled on this server (--enable-lora)",
                       type="InvalidUserInput", code="lora_disabled")
    body = await json_object(request)
    adapter = state.lora.register(_field(body, "lora_name"), _field(body, "lora_path"))
    await asyncio.sleep(adapter.bytes / DISK_BANDWIDTH * state.config.engine.time_scale)
    return web.Response(text=f"Success: LoRA adapter '{adapter.name}' added successfully.")


async def unload(request: web.Request) -> web.Response:
    state = request.app[STATE]
    if state.lora is None:
        raise APIError(400, "LoRA is not enabled on this server (--enable-lora)",
                       type="InvalidUserInput", code="lora_disabled")
    body = await json_object(request)
    name = _field(body, "lora_name")
    state.lora.unregister(name)
    return web.Response(text=f"Success: LoRA adapter '{name}' removed successfully.")
