"""The engine-to-handler channel of one request: tokens as steps produce them, then the end."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from backend.request import Status


@dataclass(slots=True)
class Delta:
    """What a request produced since the handler last looked."""

    token_ids: list[int]
    text: str
    finish: Status | None
    error: str | None = None


@dataclass(slots=True, eq=False)
class RequestStream:
    """Collects the words of one request, applies stop strings, and wakes its handler.

    ``push`` is called by the engine loop once per sampled token; it returns True when a stop
    string completed, in which case the text is cut before the stop string (as vLLM does unless
    asked to include it) and the engine finishes the request with reason ``stop``.
    """

    stop: tuple[str, ...] = ()
    text: str = ""
    emitted: int = 0  # characters of ``text`` already handed out
    token_ids: list[int] = field(default_factory=list)
    taken: int = 0  # tokens already handed out
    finish: Status | None = None
    error: str | None = None
    kv_transfer_params: dict[str, object] | None = None
    _event: asyncio.Event = field(default_factory=asyncio.Event)

    def push(self, token_id: int, text: str) -> bool:
        self.token_ids.append(token_id)
        if not self.stop:
            self.text += text
            self._event.set()
            return False
        start = max(0, len(self.text) - max(len(s) for s in self.stop))
        self.text += text
        hit = -1
        for s in self.stop:
            i = self.text.find(s, start)
            if i >= 0 and (hit < 0 or i < hit):
                hit = i
        self._event.set()
        if hit >= 0:
            self.text = self.text[:hit]
            self.emitted = min(self.emitted, hit)
            return True
        return False

    def close(self, status: Status, error: str | None = None) -> None:
        if self.finish is None:
            self.finish = status
            self.error = error
        self._event.set()

    async def next(self) -> Delta:
        """Wait for new output (or the end) and take it."""
        while self.taken == len(self.token_ids) and self.finish is None:
            self._event.clear()
            await self._event.wait()
        ids = self.token_ids[self.taken:]
        self.taken = len(self.token_ids)
        text = self.text[self.emitted:]
        self.emitted = len(self.text)
        return Delta(ids, text, self.finish, self.error)
