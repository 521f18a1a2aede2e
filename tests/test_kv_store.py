"""The KV store tier on a real Mooncake master: a block round trip between two clients, a
session's turn 2 prefilled on another engine from what turn 1 wrote (fp32 greedy outputs
equal the no-store run and transformers'), a corrupt value dropped and recomputed, a store
that is unreachable or dies while serving costs nothing but the hits."""
import random
import time

import pytest
import torch

from baton import LLM, SamplingParams
from baton.block_hash import hash_block_tokens
from baton.cluster.kv_master import start_master, stop_master
from baton.engine.block_pool import Block
from baton.engine.kv_source import KVSource
from baton.engine.kv_store import StoreTier
from baton.engine.store_client import MooncakeClient
from tests.kv_store_helpers import master, need_mooncake
from tests.reference import hf_greedy

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
BS = 4
SEGMENT = 16 << 20


@pytest.fixture(scope="module")
def store_url(tmp_path_factory):
    yield from master(tmp_path_factory)


def _ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 300) for _ in range(n)]


def _llm(folder, url=None, up: bool = True) -> LLM:
    """A tiny-pool LLM; with `url` on that store, connected before it returns when `up`."""
    extra = dict(kv_store_url=url, kv_store_segment_bytes=SEGMENT) if url else {}
    llm = LLM(str(folder), block_size=BS, num_blocks=24, **extra)
    if url and up:
        assert llm.engine.kv.tier.store.client.wait_connected(60)
    return llm


def _tier(url: str, layout_hash: int) -> StoreTier:
    kv = torch.randn(6, 2, 2, BS, 2, 8)  # [num_blocks, layers, K/V, block_size, heads, dim]
    tier = StoreTier(kv, MooncakeClient(url, SEGMENT), layout_hash, queue_bytes=1 << 20)
    assert tier.client.wait_connected(60)
    return tier


def test_block_round_trip_between_two_clients(store_url):
    a, b = _tier(store_url, 1), _tier(store_url, 1)
    try:
        tokens = tuple(range(BS))
        a.publish([Block(2, 1, block_hash=0xABC, token_ids=tokens), Block(3)])  # 3: uncached
        assert a.flush()
        assert a.totals.saved_blocks == 1
        assert b.claim(0xABC, tokens[::-1]) is None  # other tokens: dropped, not decoded
        assert b.totals.dropped_blocks == 1
        assert b.claim(0xABC, tokens) is None  # ...and removed from the store
        a._known.clear()
        a.publish([Block(2, 1, block_hash=0xABC, token_ids=tokens)])
        assert a.flush() and a.totals.saved_blocks == 2
        claim = b.claim(0xABC, tokens)
        assert claim is not None
        b.finish(claim, 5)
        assert torch.equal(b.kv_cache[5], a.kv_cache[2])
        other = _tier(store_url, 2)  # another layout: another namespace
        assert other.claim(0xABC, tokens) is None
        other.close()
    finally:
        a.close()
        b.close()


def test_a_restarted_master_is_reconnected_and_blocks_are_stored_again(tmp_path):
    """Issue 27: a master that restarts on its port has lost every object; the clients
    notice (their sentinel is gone, or a call failed and the breaker closed again), count a
    reconnect, and the tier publishes again what it believed stored, so another worker
    finds the block once more."""
    need_mooncake()
    child, url = start_master(tmp_path / "master.log")
    a = b = None
    try:
        a, b = _tier(url, 3), _tier(url, 3)
        tokens = tuple(range(BS))
        block = Block(2, 1, block_hash=0xDEF, token_ids=tokens)
        a.publish([block])
        assert a.flush() and b.claim(0xDEF, tokens) is not None
        b.finish(b.claim(0xDEF, tokens), 4)
        stop_master(child)
        child, _ = start_master(tmp_path / "master2.log", port=child.port)
        for tier in (a, b):
            tier.client.retry_s = 0.2
            _until(lambda t=tier: t.client.reconnects >= 1 and t.client.connected)
        assert b.claim(0xDEF, tokens) is None  # the new master holds nothing

        def stored_again() -> bool:
            a.publish([block])  # before the fix: "known stored", never written again
            a.flush()
            return b.client.exists_many([b.key(0xDEF)]) == [True]
        _until(stored_again)
        assert a.counts().totals.reconnects >= 1
    finally:
        for tier in (a, b):
            if tier is not None:
                tier.close()
        stop_master(child)


def _until(predicate, tries: int = 100, pause_s: float = 0.1) -> None:
    """Wait (bounded) for the writer threads' breaker checks, about one a second."""
    for _ in range(tries):
        if predicate():
            return
        time.sleep(pause_s)
    raise AssertionError("condition not met")


def _turns(folder):
    turn1 = _ids(30, seed=1)
    want1 = hf_greedy(folder, turn1, 8)
    turn2 = turn1 + want1 + _ids(6, seed=4)
    return turn1, want1, turn2


def test_turn_two_on_another_engine_computes_only_the_new_suffix(tiny_llama, store_url):
    turn1, want1, turn2 = _turns(tiny_llama)
    first, second = _llm(tiny_llama, store_url), _llm(tiny_llama, store_url)
    (out1,) = first.generate([turn1], GREEDY)
    assert out1.outputs[0].token_ids == want1
    first.engine.kv.tier.flush()  # its writer has put turn 1's blocks
    (out2,) = second.generate([turn2], GREEDY)
    (plain,) = _llm(tiny_llama).generate([turn2], GREEDY)
    assert plain.num_cached_tokens == 0
    assert out2.outputs[0].token_ids == plain.outputs[0].token_ids
    assert out2.outputs[0].token_ids == hf_greedy(tiny_llama, turn2, 8)
    # turn 1's prompt and answer: 37 tokens with KV (the last sampled one has none) = 9 blocks
    assert out2.num_cached_tokens == 9 * BS
    assert out2.cached_spans == ((KVSource.STORE, 9 * BS),)  # usage: cached_by "store"
    (store,) = second.engine.counts().kv_tiers
    assert store.tier == "store" and store.totals.loaded_blocks == 9
    assert first.engine.counts().kv_tiers[0].totals.saved_blocks == 9
    kv = second.engine.kv
    assert kv.num_free_blocks == kv.num_blocks and not kv.requests


def test_a_corrupt_store_value_is_dropped_and_recomputed(tiny_llama, store_url):
    turn1 = _ids(30, seed=11)
    first, second = _llm(tiny_llama, store_url), _llm(tiny_llama, store_url)
    first.generate([turn1], GREEDY)
    first.engine.kv.tier.flush()
    store = first.engine.kv.tier.store
    third = hash_block_tokens(turn1, BS)[2]
    good = store.client.get(store.key(third))
    bad = bytearray(good)
    bad[-5] ^= 0x40  # one flipped bit in the payload: the CRC tells
    store.client.remove(store.key(third))
    assert store.client.put(store.key(third), bytes(bad))
    turn2 = turn1 + _ids(6, seed=12)
    (out2,) = second.generate([turn2], GREEDY)
    assert out2.outputs[0].token_ids == hf_greedy(tiny_llama, turn2, 8)
    assert out2.num_cached_tokens == 2 * BS  # blocks 0, 1 loaded; 2 on recomputed
    counts = second.engine.counts()
    assert counts.kv_tier_recomputed_blocks == 1 and counts.kv_tiers[0].totals.dropped_blocks == 1


def test_an_unreachable_store_serves_as_without_it(tiny_llama):
    need_mooncake()
    from baton.cluster.kv_master import free_port
    llm = _llm(tiny_llama, f"mooncake://127.0.0.1:{free_port()}", up=False)  # no master
    prompt = _ids(30, seed=5)
    (out,) = llm.generate([prompt], GREEDY)
    assert out.outputs[0].token_ids == hf_greedy(tiny_llama, prompt, 8)
    store = llm.engine.kv.tier.store
    assert store.client.unavailable >= 1 and store.totals.saved_blocks == 0


def test_a_store_that_dies_while_serving_costs_only_its_hits(tiny_llama, tmp_path):
    need_mooncake()
    child, url = start_master(tmp_path / "master.log")
    try:
        llm = _llm(tiny_llama, url)
        first = _ids(30, seed=6)
        llm.generate([first], GREEDY)
        llm.engine.kv.tier.flush()
        assert llm.engine.counts().kv_tiers[0].totals.saved_blocks > 0
    finally:
        stop_master(child)
    store = llm.engine.kv.tier.store
    store.client.retry_s = 3600.0  # one failed call opens the breaker for the whole test
    for seed in (7, 8):
        prompt = _ids(30, seed=seed)
        (out,) = llm.generate([prompt], GREEDY)
        assert out.outputs[0].token_ids == hf_greedy(tiny_llama, prompt, 8)
    assert store.client.unavailable >= 1
    kv = llm.engine.kv
    assert kv.num_free_blocks == kv.num_blocks and not kv.requests
