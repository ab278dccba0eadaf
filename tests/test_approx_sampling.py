"""The approximate prefix index records a long prompt's blocks sampled (every block of the first
``DENSE``, one in ``STRIDE`` after, and the last): what it matches against what an index of
every block would, how it counts the blocks it holds, and how replicas share its entries."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.routing.approx_index import ApproxIndex, sampled
from gateway.routing.prefix_hints import pack, unpack


@pytest.fixture(autouse=True)
def small_sampling(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setattr(ApproxIndex, "DENSE", 8)
    monkeypatch.setattr(ApproxIndex, "STRIDE", 4)
    yield


def chain(tokens: list[int]) -> list[int]:
    """Chained block hashes: each names its whole prefix, as the router's do."""
    out, h = [], 0
    for t in tokens:
        h = hash((h, t)) & ((1 << 63) - 1)
        out.append(h)
    return out


def every_block_matched(recorded: list[list[int]], query: list[int]) -> int:
    held = {h for p in recorded for h in p}
    n = 0
    while n < len(query) and query[n] in held:
        n += 1
    return n


def test_entries_are_dense_then_one_per_run_then_the_last() -> None:
    hashes = list(range(100, 130))  # 30 blocks: dense 0-7, runs end at 11, 15, 19, 23, 27
    keys, weights = sampled(hashes)
    assert keys == [*range(100, 108), 111, 115, 119, 123, 127, 129]
    assert weights == [1] * 8 + [4] * 5 + [1]
    # from a matched block on: the same fixed positions, whatever the prompt's length
    assert sampled(hashes, 13) == ([115, 119, 123, 127, 129], [4, 4, 4, 4, 1])
    assert sampled(hashes[:28]) == ([*range(100, 108), 111, 115, 119, 123, 127], [1] * 8 + [4] * 5)
    assert sampled(hashes, 30) == ([], [])


def test_an_identical_prompt_and_an_earlier_turn_match_exactly() -> None:
    idx = ApproxIndex()
    turn1 = chain(list(range(23)))
    turn2 = chain([*range(23), 7, 7, 7, 7, 7, 7])
    idx.record("e", turn1)
    assert idx.matched("e", turn1) == 23
    assert idx.matched("e", turn2) == 23  # the earlier turn's last block was recorded
    # a prompt that stops inside a run is matched to the run before: 19 is the last run's end
    assert idx.matched("e", turn2[:22]) == 20
    assert idx.size("e") == 8 + 4 * 3 + 1  # runs end at 11, 15, 19; the last block 22


prompts = st.lists(st.lists(st.integers(0, 2), min_size=1, max_size=60), min_size=1,
                   max_size=6)


@settings(max_examples=300, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(prompts, st.lists(st.integers(0, 2), min_size=1, max_size=60))
def test_matches_what_every_block_would_to_within_one_run(recorded: list[list[int]],
                                                          query: list[int]) -> None:
    idx = ApproxIndex()
    chains = [chain(p) for p in recorded]
    for c in chains:
        idx.record("e", c, idx.matched("e", c))
    q = chain(query)
    want = every_block_matched(chains, q)
    got = idx.matched("e", q)
    assert want - (ApproxIndex.STRIDE - 1) <= got <= want
    if want <= ApproxIndex.DENSE or any(q[:want] == c for c in chains):
        assert got == want
    # the tiers walk from any block on by the same rule
    start = min(want, len(q) // 2)
    assert start <= idx.walk("e", q, start, len(q)) <= want


@settings(max_examples=200, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(prompts, st.integers(5, 40), st.booleans())
def test_the_blocks_held_are_counted_and_kept_within_the_capacity(
        recorded: list[list[int]], cap: int, in_steps: bool) -> None:
    idx = ApproxIndex()
    idx.set_capacity("e", cap)

    async def go() -> None:
        if in_steps:
            idx.chunk = 3
        for p in recorded:
            c = chain(p)
            idx.record("e", c, idx.matched("e", c))
            for _ in range(30):
                await asyncio.sleep(0)

    asyncio.run(go())
    held = idx.held("e") or {}
    assert idx.size("e") == sum(v & 31 for v in held.values())
    assert idx.size("e") <= cap * ApproxIndex.SLACK + ApproxIndex.STRIDE


def test_a_long_prompt_costs_one_entry_per_run_after_the_dense_part() -> None:
    idx = ApproxIndex()
    idx.record("e", chain([1] * 400))
    held = idx.held("e") or {}
    assert len(held) == 8 + (400 - 8) // 4
    assert idx.size("e") == 400


def test_replicas_share_entries_with_the_blocks_each_stands_for() -> None:
    a, b = ApproxIndex(), ApproxIndex()
    shared: list[tuple[str, bytes, bytes]] = []
    a.on_record = lambda url, keys, weights: shared.append(
        (url, b"".join(k.to_bytes(8, "little") for k in keys), bytes(weights)))
    prompt = chain(list(range(37)))
    a.record("http://e", prompt)
    for url, hashes, weights in unpack(pack(shared)):
        b.record_remote(url, hashes, weights)
    assert b.matched("http://e", prompt) == 37 and b.size("http://e") == a.size("http://e")
    b.record_remote("http://e", [1, 2], [1])  # a malformed hint is ignored
    assert b.size("http://e") == 37
