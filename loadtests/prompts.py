"""Prompts of exact token lengths, and Mooncake prompts whose blocks share exactly per hash id.

Every prompt is made of *words*: tokens that decode to a space and lowercase letters and encode
back to themselves (``protocol.tokenizer.Tokenizer.output_words``). The tokenizer splits text
before each such space, so a prompt of N words is exactly N tokens under that tokenizer, and a
prompt's first k·512 words are identical exactly when its first k blocks are.

For a Mooncake row, block ``i`` of the prompt is a function of ``hash_ids[i]`` alone: its first
two words encode the id itself, so blocks of different ids differ within their first two tokens
(no accidental sharing); the rest come from a generator seeded by the id. A partial last block
is a prefix of its id's full block.
"""

from __future__ import annotations

import random
from collections import OrderedDict
from collections.abc import Sequence

from protocol.tokenizer import Tokenizer

MOONCAKE_BLOCK = 512


class PromptMaker:
    """Builds prompt text of an exact token count under ``tokenizer``."""

    def __init__(self, tokenizer: Tokenizer, seed: int = 0) -> None:
        self.tokenizer = tokenizer
        self.words = tokenizer.output_words
        self._texts = [tokenizer.word_text(w) for w in self.words]
        self._rng = random.Random(seed)
        self._block_cache: OrderedDict[tuple[int, int, int], str] = OrderedDict()

    def text(self, ids: Sequence[int]) -> str:
        return "".join(self._texts[i] for i in ids)

    def random_ids(self, n: int, rng: random.Random | None = None) -> list[int]:
        """Indices (into ``words``) of ``n`` random words."""
        r = rng or self._rng
        v = len(self.words)
        return [r.randrange(v) for _ in range(n)]

    def random_text(self, n: int, rng: random.Random | None = None) -> str:
        return self.text(self.random_ids(n, rng))

    def block(self, hash_id: int, size: int = MOONCAKE_BLOCK, salt: int = 0) -> list[int]:
        """The word indices of the block named ``hash_id`` (deterministic; unique per id)."""
        v = len(self.words)
        if not 0 <= hash_id < v * v:
            raise ValueError(f"hash id {hash_id} out of range for a {v}-word vocabulary")
        rng = random.Random(hash_id * 1_000_003 + salt)
        return [hash_id % v, hash_id // v, *(rng.randrange(v) for _ in range(size - 2))]

    def _block_text(self, hash_id: int, size: int, salt: int) -> str:
        key = (hash_id, size, salt)
        text = self._block_cache.get(key)
        if text is None:
            text = self.text(self.block(hash_id, size, salt))
            self._block_cache[key] = text
            if len(self._block_cache) > 8192:
                self._block_cache.popitem(last=False)
        else:
            self._block_cache.move_to_end(key)
        return text

    def mooncake(self, hash_ids: Sequence[int], input_length: int,
                 block: int = MOONCAKE_BLOCK, salt: int = 0) -> str:
        """A prompt of exactly ``input_length`` tokens whose blocks follow ``hash_ids``."""
        need = -(-input_length // block)
        if len(hash_ids) < need:
            raise ValueError(f"{len(hash_ids)} hash ids cannot cover {input_length} tokens")
        full, rest = divmod(input_length, block)
        parts = [self._block_text(h, block, salt) for h in hash_ids[:full]]
        if rest:
            parts.append(self.text(self.block(hash_ids[full], block, salt)[:rest]))
        return "".join(parts)

    def forget_blocks(self) -> None:
        """Drop the block cache (a long replay can hold many blocks)."""
        self._block_cache.clear()
