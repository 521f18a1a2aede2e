"""Eviction order by session class (free_lists.py), TTL expiry under a controlled clock,
session end, pins that never block admission, prefetch from the KV tier."""
import random

import torch

from baton.block_hash import hash_block_tokens
from baton.engine.block_pool import BlockPool
from baton.engine.kv_cache import KVCacheManager
from baton.engine.kv_tier import KVTier
from baton.session_hints import SessionHint

SHAPE = (2, 2, 4, 1, 2)  # layers, K/V, block_size 4, kv heads, head size
BLOCK_BYTES = 2 * 2 * 4 * 1 * 2 * 4


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def _cached(pool: BlockPool, n: int, tag: int):
    """Allocate n blocks and register each under a distinct hash (tokens name it)."""
    blocks = pool.allocate(n)
    for i, b in enumerate(blocks):
        h = tag * 1000 + i
        pool.cache(b, h, (h,))
    return blocks


def _order(pool: BlockPool) -> list[int]:
    """Block ids in the order allocation takes them (peek: the pool is unchanged)."""
    return [i for i, _ in pool.free.peek(pool.num_free_blocks)]


def check_whole(pool: BlockPool) -> None:
    """Every free block sits in exactly the list its owner names; used ones in none."""
    free = list(pool.free)
    assert len(free) == len(set(free)) == pool.num_free_blocks
    for b in pool.blocks:
        if b.ref_cnt:
            assert b.block_id not in set(free) and b.owner is None
        elif b.owner is None:
            assert b.block_id in pool.free.anon
        else:
            assert b.block_id in pool.free.sessions[b.owner].free


def test_classes_evict_anon_then_expired_then_pinned_lru_inside_each():
    clock = Clock()
    pool = BlockPool(9, clock=clock)
    pinned, expired, anon = _cached(pool, 3, 1), _cached(pool, 3, 2), _cached(pool, 3, 3)
    pool.release(pinned, SessionHint("p", ttl_s=100))  # released first: LRU would take it first
    pool.release(expired, SessionHint("e", ttl_s=5))
    pool.release(anon)
    clock.t += 10  # "e" is past its TTL, "p" inside it
    assert pool.free.is_pinned("p") and not pool.free.is_pinned("e")
    ids = [[b.block_id for b in g] for g in (anon, expired, pinned)]
    assert _order(pool) == ids[0] + ids[1] + ids[2]
    check_whole(pool)
    got = pool.allocate(9)  # admission never fails because of pins
    assert [b.block_id for b in got] == ids[0] + ids[1] + ids[2]
    assert pool.free.pinned_evictions == 3 and not pool.cached
    check_whole(pool)


def test_ttl_expiry_order_follows_deadlines_not_release_order():
    clock = Clock()
    pool = BlockPool(6, clock=clock)
    long_, short = _cached(pool, 3, 1), _cached(pool, 3, 2)
    pool.release(long_, SessionHint("long", ttl_s=60))
    clock.t += 1
    pool.release(short, SessionHint("short", ttl_s=10))  # later use, earlier deadline
    assert _order(pool)[:3] == [b.block_id for b in short]
    clock.t += 30  # "short" expired, "long" still pinned
    assert not pool.free.is_pinned("short") and pool.free.is_pinned("long")
    assert _order(pool)[:3] == [b.block_id for b in short]
    # A new turn of "short" refreshes its deadline past "long"'s: now "long" goes first.
    pool.free.set_deadline("short", 60)
    assert _order(pool)[:3] == [b.block_id for b in long_]
    check_whole(pool)


def test_session_end_moves_its_blocks_first_and_late_releases_follow():
    clock = Clock()
    pool = BlockPool(8, clock=clock)
    anon, sess, live = _cached(pool, 2, 1), _cached(pool, 3, 2), _cached(pool, 2, 3)
    pool.release(anon)
    pool.release(sess, SessionHint("s", ttl_s=100))
    assert pool.end_session("s") == 3
    assert _order(pool)[:3] == [b.block_id for b in sess]  # ahead of the session-less ones
    pool.release(live, SessionHint("s", ttl_s=100))  # a turn still running at the end
    assert all(b.owner is None for b in live) and "s" not in pool.free.sessions
    check_whole(pool)
    pool.free.set_deadline("s", 100, reopen=True)  # a new turn reopens it
    got = pool.allocate(1)
    pool.cache(got[0], 99, (99,))
    pool.release(got, SessionHint("s", ttl_s=100))
    assert got[0].owner == "s"
    check_whole(pool)


def test_random_ops_keep_the_pool_whole():
    rng, clock = random.Random(0), Clock()
    pool = BlockPool(32, clock=clock)
    held: list = []
    for step in range(3000):
        op = rng.random()
        if op < 0.45 and pool.num_free_blocks:
            blocks = pool.allocate(rng.randint(1, min(4, pool.num_free_blocks)))
            for b in blocks:
                if rng.random() < 0.7:
                    pool.cache(b, step * 10 + b.block_id, (b.block_id,))
            held.append(blocks)
        elif op < 0.85 and held:
            blocks = held.pop(rng.randrange(len(held)))
            sid = rng.choice([None, "a", "b", "c", "d"])
            pool.release(blocks, SessionHint(sid, rng.choice([0, 5, 50])) if sid else None)
        elif op < 0.9:
            pool.end_session(rng.choice("abcd"))
        elif op < 0.95 and pool.cached:  # a prefix hit on a cached block
            b = pool.blocks[rng.choice(list(pool.cached.values()))]
            pool.touch([b])
            held.append([b])
        else:
            clock.t += rng.choice([1, 10])
        if step % 100 == 0:
            check_whole(pool)
    for blocks in held:
        pool.release(blocks, SessionHint("a", 5))
    check_whole(pool)
    assert pool.num_free_blocks == 32 and len(pool.free.peek(32)) == 32


def _tiered(num_blocks: int, clock=None):
    kv = torch.zeros(num_blocks, *SHAPE)
    tier = KVTier(kv, host_bytes=16 * BLOCK_BYTES)
    return kv, tier, KVCacheManager(num_blocks, 4, tier=tier, clock=clock or Clock())


def _run(mgr: KVCacheManager, kv: torch.Tensor, rid: str, tokens: list[int],
         hint: SessionHint | None = None) -> None:
    """A whole request: bind, hits, allocate, write KV (block content = first token), free."""
    mgr.bind_session(rid, hint)
    hits, n = mgr.get_computed_blocks(rid, tokens)
    mgr.allocate_slots(rid, len(tokens), hits)
    for i, b in enumerate(mgr.block_table(rid)[n // 4:], start=n // 4):
        kv[b].fill_(float(tokens[i * 4]))
    mgr.cache_blocks(rid, tokens, len(tokens))
    mgr.free(rid)


def test_pinned_blocks_evicted_when_nothing_else_is_go_to_the_tier():
    kv, tier, mgr = _tiered(4)
    a = list(range(100, 116))  # 4 blocks: the whole pool, pinned
    _run(mgr, kv, "a", a, SessionHint("s", ttl_s=600))
    assert mgr.pool.free.num_session_free == 4
    _run(mgr, kv, "b", list(range(200, 209)))  # session-less: must still be admitted
    assert mgr.pool.free.pinned_evictions == 3
    assert len(set(hash_block_tokens(a, 4)) & set(tier.host.index)) == 3


def test_prefetch_on_arrival_leaves_nothing_to_load_at_admission():
    kv, tier, mgr = _tiered(6)
    turn1 = list(range(100, 116))  # 4 blocks
    _run(mgr, kv, "t1", turn1, SessionHint("s", ttl_s=30))
    _run(mgr, kv, "x", list(range(300, 324)))  # 6 blocks: turn 1 demoted to the tier
    h1 = hash_block_tokens(turn1, 4)
    assert not set(h1) & set(mgr.pool.cached) and set(h1) <= set(tier.host.index)
    turn2 = turn1 + [7, 8, 9]
    hint = SessionHint("s", ttl_s=30)
    mgr.bind_session("t2", hint)
    assert mgr.prefetch("t2", turn2) == 4 and mgr.prefetched_blocks == 4
    loaded = tier.host_totals.loaded_blocks
    assert all(mgr.pool.blocks[mgr.pool.cached[h]].owner == "s" for h in h1)  # its own list
    hits, n = mgr.get_computed_blocks("t2", turn2)
    assert n == 16 and tier.host_totals.loaded_blocks == loaded  # nothing loaded now
    assert [float(kv[b.block_id].flatten()[0]) for b in hits] == [100.0, 104.0, 108.0, 112.0]
    assert mgr.allocate_slots("t2", len(turn2), hits) is not None
    assert mgr.pool.prefetch_hits == 4 and mgr.pool.prefetch_wasted == 0
    mgr.free("t2")
    assert mgr.num_free_blocks == 6 and not mgr.hints
    check_whole(mgr.pool)


def test_prefetch_takes_only_class_a_blocks():
    kv, tier, mgr = _tiered(6)
    turn1 = list(range(100, 116))
    _run(mgr, kv, "t1", turn1)
    _run(mgr, kv, "p", list(range(300, 324)), SessionHint("other", ttl_s=600))  # pins all 6
    mgr.bind_session("t2", SessionHint("s", ttl_s=30))
    assert mgr.prefetch("t2", turn1 + [1]) == 0  # no class-(a) block: other's pin stays
    assert mgr.pool.free.pinned_evictions == 0
    mgr.free("t2")
    check_whole(mgr.pool)


def test_idle_restore_brings_a_pinned_sessions_demoted_prefix_back():
    clock = Clock()
    kv, tier, mgr = _tiered(6, clock)
    turn1 = list(range(100, 116))  # 4 blocks
    hint = SessionHint("s", ttl_s=30)
    _run(mgr, kv, "t1", turn1, hint)
    deadline = mgr.pool.free.sessions["s"].deadline
    mgr.allocate_slots("busy", 24)  # the whole pool: nothing else free, so pins go
    assert mgr.pool.free.pinned_evictions == 4 and list(mgr.pool.free.demoted) == ["s"]
    assert mgr.restore_sessions() == 0  # no free class-(a) block yet
    mgr.free("busy")  # uncached: class (a)
    clock.t += 5
    assert mgr.restore_sessions() == 4 and not mgr.pool.free.demoted
    assert mgr.pool.free.sessions["s"].deadline == deadline  # a restore is not a use
    h1 = hash_block_tokens(turn1, 4)
    assert all(mgr.pool.blocks[mgr.pool.cached[h]].owner == "s" for h in h1)
    loaded = tier.host_totals.loaded_blocks
    mgr.bind_session("t2", hint)
    hits, n = mgr.get_computed_blocks("t2", turn1 + [5, 6])
    assert n == 16 and tier.host_totals.loaded_blocks == loaded
    mgr.allocate_slots("t2", 18, hits)
    assert mgr.pool.prefetch_hits == 4
    mgr.free("t2")
    check_whole(mgr.pool)


def test_no_restore_once_the_ttl_passed_or_the_session_ended():
    clock = Clock()
    for how in ("expired", "ended"):
        kv, tier, mgr = _tiered(6, clock)
        _run(mgr, kv, "t1", list(range(100, 116)), SessionHint("s", ttl_s=30))
        mgr.allocate_slots("busy", 24)
        mgr.free("busy")
        if how == "expired":
            clock.t += 31
        else:
            mgr.end_session("s")
        assert mgr.restore_sessions() == 0 and mgr.prefetched_blocks == 0
        check_whole(mgr.pool)
