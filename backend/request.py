"""One generation request as the engine sees it."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from protocol.kv_hash import BlockHash


class Status(enum.Enum):
    WAITING = "waiting"
    WAITING_FOR_REMOTE_KVS = "waiting_for_remote_kvs"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        return self in (Status.FINISHED_STOPPED, Status.FINISHED_LENGTH, Status.FINISHED_ABORTED)


@dataclass(slots=True, eq=False)
class RemotePrefill:
    """Decode side of a prefill/decode handoff: where to pull the prompt's KV from."""

    params: dict[str, Any]
    started: bool = False
    hit_tokens: int = 0  # prompt tokens this instance already had cached
    pulled_tokens: int = 0
    failed: bool = False


@dataclass(slots=True, eq=False)
class Request:
    """Token state of a request. ``token_ids`` is the prompt followed by generated tokens.

    ``target_output_tokens`` is when the (simulated) model emits end-of-sequence; it never
    exceeds ``max_tokens``. Counting follows vLLM v1: a step advances
    ``num_computed_tokens`` toward ``num_tokens``; a step that reaches it samples one token.
    """

    request_id: str
    prompt_token_ids: list[int]
    max_tokens: int
    target_output_tokens: int
    arrival_time: float
    cache_salt: str | None = None
    model: str = ""  # the served model it names (an instance may host several)
    lora: str | None = None  # the LoRA adapter it runs with (``backend.lora``)
    priority: int = 0  # lower first, under ``--scheduling-policy priority`` (as vLLM)
    remote_decode: bool = False  # prefill side: keep the KV for a decode instance to pull
    remote_prefill: RemotePrefill | None = None
    pool_prefix: int = 0  # leading prompt blocks the shared KV pool held on arrival
    tier_hit: Any = None  # backend.kv_tiers.TierHit of a load from host memory or the pool
    tiers_tried: bool = False  # a lower-tier load was tried (and gave nothing): not again
    token_ids: list[int] = field(init=False)
    block_hashes: list[BlockHash] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = -1  # prefix-cache hit at first scheduling (-1: not yet)
    num_preemptions: int = 0
    status: Status = Status.WAITING
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None

    def __post_init__(self) -> None:
        self.token_ids = list(self.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    def append_output(self, token_id: int) -> Status | None:
        """Record a sampled token; return the finish status if the sequence is now done."""
        self.token_ids.append(token_id)
        return self.finish_status()

    def finish_status(self) -> Status | None:
        """How the sequence ends with the tokens it has (None: it goes on)."""
        n = self.num_output_tokens
        if n >= self.max_tokens:
            return Status.FINISHED_LENGTH
        if n >= self.target_output_tokens:
            return Status.FINISHED_STOPPED
        return None
