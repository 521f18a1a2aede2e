"""Exact block bookkeeping: block ids, ref counts, free order, prefix hits, eviction."""
import random
from collections import Counter

import pytest

from baton.block_hash import hash_block, hash_block_tokens
from baton.engine.kv_cache import BlockPool, KVCacheManager


def ids(blocks):
    return [b.block_id for b in blocks]


def test_chained_hashes_are_stable_and_depend_on_the_prefix():
    a = hash_block_tokens([1, 2, 3, 4, 5, 6, 7, 8, 9], block_size=4)
    assert len(a) == 2  # only full blocks
    assert a[1] == hash_block(a[0], [5, 6, 7, 8])
    b = hash_block_tokens([9, 2, 3, 4, 5, 6, 7, 8], block_size=4)
    assert b[1] != a[1]  # same tokens, different parent
    assert 0 <= a[0] < 2**64
    full = hash_block_tokens(list(range(12)), 4)
    assert hash_block_tokens(list(range(12)), 4, start_hashes=full[:1]) == full
    # Same value in any process: a subprocess computes the same hash (no salted hash()).
    import subprocess
    import sys
    out = subprocess.run([sys.executable, "-c", "from baton.block_hash import hash_block;"
                          "print(hash_block(0, [1, 2, 3, 4]))"], capture_output=True, text=True,
                         check=True)
    assert int(out.stdout) == hash_block(0, [1, 2, 3, 4])


def test_allocate_in_order_and_free_last_block_first():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    new = kv.allocate_slots("a", 10)  # 3 blocks
    assert ids(new) == [0, 1, 2]
    assert [b.ref_cnt for b in kv.pool.blocks[:3]] == [1, 1, 1]
    assert kv.num_free_blocks == 5
    assert ids(kv.allocate_slots("a", 12)) == []  # still fits in 3 blocks
    assert ids(kv.allocate_slots("a", 13)) == [3]
    kv.cache_blocks("a", list(range(13)), 13)  # blocks 0..2 full → cached
    kv.free("a")
    # Unhashed block 3 goes to the head (reused first); cached blocks are queued last-first.
    assert list(kv.pool.free_queue)[:1] == [3]
    assert list(kv.pool.free_queue)[-3:] == [2, 1, 0]
    assert kv.num_free_blocks == 8 and all(b.ref_cnt == 0 for b in kv.pool.blocks)


def test_prefix_hit_takes_cached_blocks_and_leaves_one_token():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    prompt = list(range(100, 112))  # exactly 3 blocks
    kv.allocate_slots("a", 12)
    kv.cache_blocks("a", prompt, 12)
    kv.free("a")
    hits, n = kv.get_computed_blocks("b", prompt)
    assert ids(hits) == [0, 1] and n == 8  # the last token must be recomputed
    kv.allocate_slots("b", 12, hits)
    assert kv.block_table("b")[:2] == [0, 1]
    assert kv.pool.blocks[0].ref_cnt == 1
    hits_c, n_c = kv.get_computed_blocks("c", prompt + [7])
    assert ids(hits_c) == [0, 1, 2] and n_c == 12
    kv.allocate_slots("c", 13, hits_c)
    assert kv.pool.blocks[0].ref_cnt == 2 and kv.pool.blocks[1].ref_cnt == 2
    kv.free("b")
    kv.free("c")
    assert kv.num_free_blocks == 8


def test_allocation_counts_reclaimed_free_hits_and_fails_atomically():
    kv = KVCacheManager(num_blocks=4, block_size=4)
    kv.allocate_slots("a", 8)
    kv.cache_blocks("a", list(range(8)), 8)
    kv.free("a")  # blocks 0, 1 cached and free
    hits, n = kv.get_computed_blocks("b", list(range(8)) + [1])
    assert n == 8
    # 2 hits (both free) + 3 new blocks for 20 tokens = 5 > 4: refused, nothing changes.
    assert kv.allocate_slots("b", 20, hits) is None
    assert kv.num_free_blocks == 4 and "b" not in kv.requests
    assert kv.pool.cached  # hashes intact
    assert kv.allocate_slots("b", 16, hits) is not None
    assert kv.num_free_blocks == 0


def test_lru_eviction_drops_hash_of_reused_block():
    kv = KVCacheManager(num_blocks=3, block_size=2)
    kv.allocate_slots("a", 4)
    kv.cache_blocks("a", [1, 2, 3, 4], 4)
    kv.free("a")
    assert len(kv.pool.cached) == 2
    kv.allocate_slots("b", 4)  # free queue: [2, 1, 0] → takes 2, then 1 (evicting a's 2nd)
    assert kv.block_table("b") == [2, 1]
    assert len(kv.pool.cached) == 1
    hits, n = kv.get_computed_blocks("c", [1, 2, 3, 4, 5])
    assert ids(hits) == [0] and n == 2


def test_hash_collision_checks_tokens():
    truncated = lambda parent, toks: 1  # every block collides  # noqa: E731
    kv = KVCacheManager(num_blocks=8, block_size=2, hash_fn=truncated)
    kv.allocate_slots("a", 4)
    kv.cache_blocks("a", [1, 2, 3, 4], 4)
    kv.free("a")
    hits, n = kv.get_computed_blocks("b", [9, 9, 9, 9, 9])
    assert hits == [] and n == 0  # same hash, different tokens: no reuse
    hits, n = kv.get_computed_blocks("c", [1, 2, 7, 7, 7])
    assert ids(hits) == [0] and n == 2


def test_double_release_is_refused():
    pool = BlockPool(4)
    (b,) = pool.allocate(1)
    pool.release([b])
    with pytest.raises(AssertionError):
        pool.release([b])
    assert pool.num_free_blocks == 4
    assert list(pool.free_queue).count(b.block_id) == 1


def test_block_listed_twice_in_one_release_is_refused_whole():
    """Case 9: the same block twice in one release (one reference) is refused before
    anything changes: never queued twice, the other blocks of the call untouched."""
    pool = BlockPool(4)
    a, b = pool.allocate(2)
    with pytest.raises(AssertionError, match=r"\[1\]"):
        pool.release([a, b, b])
    assert (a.ref_cnt, b.ref_cnt, pool.num_free_blocks) == (1, 1, 2)
    pool.touch([b])  # two references: listing it twice is right
    pool.release([a, b, b])
    assert pool.num_free_blocks == 4 and sorted(pool.free_queue) == [0, 1, 2, 3]


def test_no_drift_after_many_requests():
    kv = KVCacheManager(num_blocks=16, block_size=4)
    for i in range(2000):
        toks = [i % 7] * (5 + i % 11)
        hits, n = kv.get_computed_blocks(str(i), toks)
        assert kv.allocate_slots(str(i), len(toks), hits) is not None
        kv.cache_blocks(str(i), toks, len(toks))
        assert 0.0 <= kv.usage <= 1.0
        kv.free(str(i))
    assert kv.num_free_blocks == 16 and not kv.requests
    assert all(b.ref_cnt == 0 for b in kv.pool.blocks)
    assert len(kv.pool.free_queue) == len(set(kv.pool.free_queue)) == 16


def test_no_drift_with_interleaved_requests():
    """Case 8 with requests overlapping: thousands of requests share prefixes, grow a token
    at a time, are preempted (freed mid-way) or finish, in random order. After every step
    each block's ref_cnt equals the number of block tables holding it, the free count equals
    the unreferenced blocks (each queued once) and usage stays in [0, 1]."""
    rng = random.Random(0)
    kv = KVCacheManager(num_blocks=32, block_size=4)
    live: dict[str, list[int]] = {}

    def check() -> None:
        refs = Counter(b for rid in kv.requests for b in kv.block_table(rid))
        assert all(b.ref_cnt == refs[b.block_id] for b in kv.pool.blocks)
        unreferenced = sum(b.ref_cnt == 0 for b in kv.pool.blocks)
        assert kv.num_free_blocks == len(set(kv.pool.free_queue)) == unreferenced
        assert 0.0 <= kv.usage <= 1.0

    for i in range(3000):
        op = rng.random()
        if op < 0.35 or not live:  # arrive; a 3-token alphabet makes prefixes collide
            rid, toks = f"r{i}", [rng.randrange(3) for _ in range(rng.randrange(1, 24))]
            hits, _ = kv.get_computed_blocks(rid, toks)
            if kv.allocate_slots(rid, len(toks), hits) is not None:
                kv.cache_blocks(rid, toks, len(toks))
                live[rid] = toks
        elif op < 0.85:  # decode one token; no room → preempted (freed, recomputed later)
            rid = rng.choice(list(live))
            live[rid].append(rng.randrange(3))
            if kv.allocate_slots(rid, len(live[rid])) is None:
                kv.free(rid)
                del live[rid]
            else:
                kv.cache_blocks(rid, live[rid], len(live[rid]))
        else:  # finish
            rid = rng.choice(list(live))
            kv.free(rid)
            del live[rid]
        check()
    for rid in list(live):
        kv.free(rid)
    check()
    assert kv.num_free_blocks == 32 and not kv.requests
