"""A headless Service's endpoints: its DNS name resolved every ``interval_s`` (each address
one endpoint on the configured port). A failed lookup keeps the last addresses."""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Callable

from gateway.config.discovery import Discovery

log = logging.getLogger("tokengate.discovery")

Addresses = list[tuple[str, int, str]]  # (ip, port, role)


async def resolve(name: str, port: int) -> Addresses:
    infos = await asyncio.get_running_loop().getaddrinfo(name, port, type=socket.SOCK_STREAM)
    return sorted({(str(info[4][0]), port, "both") for info in infos})


async def follow(d: Discovery, on_change: Callable[[Addresses], None],
                 synced: asyncio.Event) -> None:
    """Resolve ``d.name`` until cancelled, telling ``on_change`` each new set."""
    assert d.port is not None
    last: Addresses | None = None
    while True:
        try:
            now = await resolve(d.name, d.port)
        except OSError as exc:
            log.warning("discovery: cannot resolve %s (%s); endpoints kept: %d", d.name, exc,
                        len(last or ()))
        else:
            if now != last:
                last = now
                on_change(now)
            synced.set()
        await asyncio.sleep(d.interval_s)
