"""vLLM's runtime LoRA endpoints on the reference backend (``backend.lora`` says what they do);
registered only when ``VLLM_ALLOW_RUNTIME_LORA_UPDATING`` is true, as vLLM registers them."""

from __future__ import annotations

import asyncio

from aiohttp import web

from backend.lora import LoraRegistry
from backend.state import STATE
from protocol.bodies import json_object
from protocol.errors import APIError

DISK_BANDWIDTH = 6e9  # bytes/s: an adapter is read from local disk (roofline.switching's)


def _field(body: dict[str, object], key: str) -> str:
    value = body.get(key)
    return value if isinstance(value, str) else ""


async def _registry(request: web.Request) -> tuple[LoraRegistry, dict[str, object]]:
    registry = request.app[STATE].lora
    if registry is None:
        raise APIError(400, "LoRA is not enabled on this server (--enable-lora)",
                       type="InvalidUserInput", code="lora_disabled")
    return registry, await json_object(request)


async def load(request: web.Request) -> web.Response:
    registry, body = await _registry(request)
    adapter = registry.register(_field(body, "lora_name"), _field(body, "lora_path"))
    scale = request.app[STATE].config.engine.time_scale
    await asyncio.sleep(adapter.bytes / DISK_BANDWIDTH * scale)
    return web.Response(text=f"Success: LoRA adapter '{adapter.name}' added successfully.")


async def unload(request: web.Request) -> web.Response:
    registry, body = await _registry(request)
    name = _field(body, "lora_name")
    registry.unregister(name)
    return web.Response(text=f"Success: LoRA adapter '{name}' removed successfully.")
