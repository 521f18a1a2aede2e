"""The KV tier's bookkeeping: exact LRU order per tier, loads back into the pool, bad files."""
import os

import pytest
import torch

from baton.block_hash import hash_block_tokens
from baton.engine.block_pool import Block
from baton.engine.kv_cache import KVCacheManager
from baton.engine.kv_tier import KVTier
from baton.engine.tier_store import _HEADER

SHAPE = (2, 2, 4, 1, 2)  # layers, K/V, block_size 4, kv heads, head size
BLOCK_BYTES = 2 * 2 * 4 * 1 * 2 * 4
FILE_BYTES = _HEADER.size + 4 * 4 + BLOCK_BYTES


def _cache(num_blocks: int) -> torch.Tensor:
    return torch.arange(num_blocks * BLOCK_BYTES // 4, dtype=torch.float32).reshape(
        num_blocks, *SHAPE)


def _block(kv: torch.Tensor, block_id: int, h: int) -> Block:
    kv[block_id].fill_(float(h))  # the block's content names its hash
    return Block(block_id, 0, h, (h, h, h, h))


def _claim_into(tier: KVTier, kv: torch.Tensor, h: int, block_id: int) -> bool:
    claim = tier.claim(h, (h, h, h, h))
    if claim is None:
        return False
    tier.finish(claim, block_id)
    return True


def test_lru_order_host_then_disk_is_exact(tmp_path):
    kv = _cache(2)
    tier = KVTier(kv, host_bytes=3 * BLOCK_BYTES, disk_dir=str(tmp_path),
                  disk_bytes=2 * FILE_BYTES)
    for h in (1, 2, 3, 4):  # host holds 3: the 4th pushes 1 (LRU) to disk
        tier.offload([_block(kv, 0, h)])
    assert list(tier.host.index) == [2, 3, 4] and list(tier.disk.index) == [1]
    tier.offload([_block(kv, 0, 5), _block(kv, 1, 6)])  # 2, 3 down; disk full: 1 deleted
    assert list(tier.host.index) == [4, 5, 6] and list(tier.disk.index) == [2, 3]
    assert sorted(os.listdir(tier.disk.dir)) == [f"{2:016x}.kv", f"{3:016x}.kv"]
    # A disk hit keeps the file and makes it most recent: 3 is evicted next, not 2.
    assert _claim_into(tier, kv, 2, 1) and torch.all(kv[1] == 2.0)
    assert list(tier.disk.index) == [3, 2]
    # A host hit moves the block up: its slot is free again.
    assert _claim_into(tier, kv, 5, 0) and torch.all(kv[0] == 5.0)
    assert list(tier.host.index) == [4, 6] and len(tier.host.free_slots) == 1
    tier.offload([_block(kv, 0, 7)])  # a free slot: nothing moves down
    assert list(tier.host.index) == [4, 6, 7] and list(tier.disk.index) == [3, 2]
    tier.offload([_block(kv, 0, 8)])  # 4 down, 3 (disk LRU) deleted
    assert list(tier.host.index) == [6, 7, 8] and list(tier.disk.index) == [2, 4]
    assert tier.disk.used_bytes == 2 * FILE_BYTES
    host, disk = tier.counts()
    assert (host.tier, host.blocks, host.bytes) == ("host", 3, 3 * BLOCK_BYTES)
    assert (disk.tier, disk.blocks, disk.bytes) == ("disk", 2, 2 * FILE_BYTES)
    assert host.totals.hits == 1 and disk.totals.hits == 1 and disk.totals.misses == 0
    assert not _claim_into(tier, kv, 99, 0)
    assert tier.host_totals.misses == 2 and tier.disk_totals.misses == 1


def test_a_block_recomputed_while_in_the_tier_is_touched_not_copied(tmp_path):
    kv = _cache(1)
    tier = KVTier(kv, host_bytes=2 * BLOCK_BYTES)
    for h in (1, 2, 1):
        tier.offload([_block(kv, 0, h)])
    assert list(tier.host.index) == [2, 1] and tier.host_totals.saved_blocks == 2


def test_tokens_are_checked_on_a_tier_hit(tmp_path):
    kv = _cache(1)
    tier = KVTier(kv, host_bytes=BLOCK_BYTES, disk_dir=str(tmp_path), disk_bytes=FILE_BYTES)
    tier.offload([_block(kv, 0, 1), _block(kv, 0, 2)])  # 1 on disk, 2 in host
    assert tier.claim(1, (9, 9, 9, 9)) is None and tier.claim(2, (9, 9, 9, 9)) is None
    assert 1 in tier.disk and 2 in tier.host  # a collision is a miss, not a loss


@pytest.mark.parametrize("damage", ["flip_payload", "flip_tokens", "truncate", "append",
                                    "delete"])
def test_a_bad_disk_file_is_dropped_never_loaded(tmp_path, damage):
    kv = _cache(2)
    tier = KVTier(kv, disk_dir=str(tmp_path), disk_bytes=4 * FILE_BYTES)  # disk only
    tier.offload([_block(kv, 0, 7)])
    path = tier.disk.path(7)
    data = bytearray(open(path, "rb").read())
    assert len(data) == FILE_BYTES
    if damage == "flip_payload":
        data[-5] ^= 0xFF
    elif damage == "flip_tokens":
        data[_HEADER.size] ^= 0x01
    elif damage == "truncate":
        data = data[:-1]
    elif damage == "append":
        data += b"\0"
    if damage == "delete":
        os.unlink(path)
    else:
        open(path, "wb").write(bytes(data))
    kv[1].fill_(-1.0)
    assert not _claim_into(tier, kv, 7, 1)
    assert torch.all(kv[1] == -1.0)  # the pool block was never touched
    assert 7 not in tier.disk and not os.path.exists(path) and tier.disk.used_bytes == 0
    assert tier.disk_totals.dropped_blocks == 1 and tier.recomputed_blocks == 1


def _fill(kv_mgr: KVCacheManager, kv: torch.Tensor, rid: str, tokens: list[int]) -> list[int]:
    """Run a request's whole prompt through the manager, writing block contents by id."""
    kv_mgr.allocate_slots(rid, len(tokens))
    table = kv_mgr.block_table(rid)
    for i, b in enumerate(table):
        kv[b].fill_(float(tokens[i * 4]))
    kv_mgr.cache_blocks(rid, tokens, len(tokens))
    kv_mgr.free(rid)
    return table


def test_a_prefix_evicted_to_the_host_tier_is_loaded_back_as_hits():
    kv = _cache(4)
    tier = KVTier(kv, host_bytes=8 * BLOCK_BYTES)
    mgr = KVCacheManager(num_blocks=4, block_size=4, tier=tier)
    a = list(range(100, 112))  # 3 blocks
    _fill(mgr, kv, "a", a)
    _fill(mgr, kv, "b", list(range(200, 216)))  # 4 blocks: a's 3 evicted (to the host tier)
    ha = hash_block_tokens(a, 4)
    assert set(ha) <= set(tier.host.index)
    hits, n = mgr.get_computed_blocks("c", a + [1])
    assert n == 12 and [b.block_hash for b in hits] == ha
    assert [float(kv[b.block_id].flatten()[0]) for b in hits] == [100.0, 104.0, 108.0]
    assert all(b.ref_cnt == 0 for b in hits) and not set(ha) & set(tier.host.index)
    # The three blocks taken for the loads evicted three of b's into the host tier.
    assert len(tier.host.index) == 3 and tier.host_totals.loaded_blocks == 3
    assert mgr.allocate_slots("c", 13, hits) is not None
    assert mgr.block_table("c")[:3] == [b.block_id for b in hits]
    mgr.free("c")
    assert mgr.num_free_blocks == 4 and all(b.ref_cnt == 0 for b in mgr.pool.blocks)
    assert len(tier.host.index) + len(tier.host.free_slots) == tier.host.num_slots


def test_loading_never_evicts_the_pool_hits_it_extends():
    kv = _cache(4)
    tier = KVTier(kv, host_bytes=8 * BLOCK_BYTES)
    mgr = KVCacheManager(num_blocks=4, block_size=4, tier=tier)
    a = list(range(100, 112))
    _fill(mgr, kv, "a", a)  # blocks 0, 1, 2 hold a0, a1, a2; free queue [3, 2, 1, 0]
    y = [7] * 8
    _fill(mgr, kv, "y", y)  # blocks 3, 2 (a2 → host tier), then freed as MRU
    assert list(mgr.pool.free_queue) == [1, 0, 2, 3]  # a1 heads the queue
    hits, n = mgr.get_computed_blocks("c", a + [1])
    assert n == 12 and [b.block_id for b in hits] == [0, 1, 2]  # a0, a1 kept; a2 into 2
    assert float(kv[2].flatten()[0]) == 108.0
    assert list(tier.host.index) == [hash_block_tokens(y, 4)[1]]  # y's block 2 went down


def test_both_workers_expose_the_tier_series():
    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from baton.engine.kv_tier import TierCounts, TierTotals
    from baton.engine.stats import EngineCounts
    from decode_service.metrics import DecodeMetrics
    from prefill_service.metrics import PrefillMetrics

    host = TierCounts("host", 3, 3 * BLOCK_BYTES, 8 * BLOCK_BYTES,
                      TierTotals(hits=5, misses=2, saved_bytes=640, load_seconds=0.25))
    disk = TierCounts("disk", 1, FILE_BYTES, 4 * FILE_BYTES, TierTotals(dropped_blocks=1))
    from baton.engine.kv_source import KVSource
    by = ((KVSource.POOL, 32), (KVSource.HOST_TIER, 12), (KVSource.DISK_TIER, 4))
    counts = EngineCounts(0, 0, 0, 4, 4, kv_tiers=(host, disk), kv_tier_recomputed_blocks=1,
                          cached_tokens_by_source=by)

    class Engine:
        def counts(self):
            return counts

    for m in (DecodeMetrics("m"), PrefillMetrics("m")):
        m.watch(Engine(), *([{}] if isinstance(m, PrefillMetrics) else []))
        text = generate_latest(m.registry).decode()
        got = {(s.name, s.labels.get("tier")): s.value
               for f in text_string_to_metric_families(text) for s in f.samples
               if s.name.startswith("baton_kv_tier")}
        assert got[("baton_kv_tier_blocks", "host")] == 3
        assert got[("baton_kv_tier_capacity_bytes", "disk")] == 4 * FILE_BYTES
        assert got[("baton_kv_tier_hits_total", "host")] == 5
        assert got[("baton_kv_tier_misses_total", "host")] == 2
        assert got[("baton_kv_tier_saved_bytes_total", "host")] == 640
        assert got[("baton_kv_tier_load_seconds_total", "host")] == 0.25
        assert got[("baton_kv_tier_dropped_blocks_total", "disk")] == 1
        assert got[("baton_kv_tier_recomputed_blocks_total", None)] == 1
        sources = {s.labels["source"]: s.value for f in text_string_to_metric_families(text)
                   for s in f.samples if s.name == "baton_kv_cached_prompt_tokens_total"}
        assert sources == {"pool": 32, "host_tier": 12, "disk_tier": 4}


def test_a_prompt_that_cannot_fit_loads_nothing():
    kv = _cache(4)
    tier = KVTier(kv, host_bytes=8 * BLOCK_BYTES)
    mgr = KVCacheManager(num_blocks=4, block_size=4, tier=tier)
    a = list(range(100, 112))
    _fill(mgr, kv, "a", a)
    _fill(mgr, kv, "b", list(range(200, 216)))  # a's 3 blocks now in the host tier
    before = list(tier.host.index)
    assert mgr.get_computed_blocks("c", a + [1], reserved_blocks=1) == ([], 0)  # 4 + 1 > 4
    assert list(tier.host.index) == before and tier.host_totals.hits == 0
    hits, n = mgr.get_computed_blocks("c", a + [1], reserved_blocks=0)
    assert n == 12 and mgr.fits(13, hits, 0) and not mgr.fits(13, hits, 1)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_blocks_round_trip_bit_exact(tmp_path, dtype):
    kv = torch.randn(3, *SHAPE).to(dtype)
    tier = KVTier(kv, host_bytes=BLOCK_BYTES // 2, disk_dir=str(tmp_path),
                  disk_bytes=4 * FILE_BYTES)  # one host slot: the first block goes to disk
    want = kv[:2].clone()
    tier.offload([Block(0, 0, 1, (1,) * 4), Block(1, 0, 2, (2,) * 4)])
    assert list(tier.disk.index) == [1] and list(tier.host.index) == [2]
    kv.zero_()
    for h, block_id in ((1, 2), (2, 0)):
        tier.finish(tier.claim(h, (h,) * 4), block_id)
    assert torch.equal(kv[2].view(torch.int16), want[0].view(torch.int16))
    assert torch.equal(kv[0].view(torch.int16), want[1].view(torch.int16))


def test_tier_flags_reach_the_cache_config():
    from baton.config import CacheConfig, EngineConfig
    from baton.flagspec import build, parser_for

    p = parser_for(EngineConfig, "engine", "")
    off = build(EngineConfig, p.parse_args([])).cache
    assert not off.kv_tier_enabled and off.kv_host_tier_bytes == 0
    on = build(EngineConfig, p.parse_args([
        "--kv-host-tier-bytes", "1048576", "--kv-disk-tier-dir", "/tmp/x",
        "--kv-disk-tier-bytes", "4096"])).cache
    assert (on.kv_host_tier_bytes, on.kv_disk_tier_dir, on.kv_disk_tier_bytes) == (
        1 << 20, "/tmp/x", 4096) and on.kv_tier_enabled
    assert not CacheConfig(kv_host_tier_bytes=1, enable_prefix_caching=False).kv_tier_enabled
    with pytest.raises(ValueError):
        CacheConfig(kv_host_tier_bytes=-1)


def test_disk_writes_run_behind_and_a_hit_meanwhile_reads_the_host_slot(tmp_path):
    import threading

    kv = _cache(2)
    tier = KVTier(kv, host_bytes=16 * BLOCK_BYTES, disk_dir=str(tmp_path),
                  disk_bytes=64 * FILE_BYTES)
    assert tier.spill_ahead == 2
    gate = threading.Event()
    tier._writer.submit(gate.wait)  # the writer stalls: every spill stays queued
    try:
        for h in range(1, 17):
            tier.offload([_block(kv, 0, h)])
        # 16 saved in 16 slots: the 2 LRU blocks are queued for disk ahead of need.
        assert list(tier.disk.index) == [1, 2] and list(tier.host.index) == list(range(3, 17))
        assert tier._pending_slots == 2 and os.listdir(tier.disk.dir) == []
        assert _claim_into(tier, kv, 1, 1) and torch.all(kv[1] == 1.0)  # from its host slot
    finally:
        gate.set()
    tier.flush()
    assert sorted(os.listdir(tier.disk.dir)) == [f"{1:016x}.kv", f"{2:016x}.kv"]
    assert tier._pending_slots == 0 and len(tier.host.free_slots) == 2
    assert tier.disk_totals.saved_blocks == 2 and tier.disk_totals.dropped_blocks == 0
    kv[1].fill_(0.0)
    assert _claim_into(tier, kv, 2, 1) and torch.all(kv[1] == 2.0)  # now from its file


def test_a_failed_background_write_is_dropped_and_counted(tmp_path):
    import shutil

    kv = _cache(1)
    tier = KVTier(kv, host_bytes=BLOCK_BYTES, disk_dir=str(tmp_path), disk_bytes=4 * FILE_BYTES)
    shutil.rmtree(tier.disk.dir)  # every write now fails
    for h in (1, 2):
        tier.offload([_block(kv, 0, h)])  # 1 spilled to a disk that is gone
    tier.flush()
    assert 1 not in tier.disk and tier.disk.used_bytes == 0 and list(tier.host.index) == [2]
    assert tier.disk_totals.dropped_blocks == 1 and tier.disk_totals.saved_blocks == 0
    assert tier.claim(1, (1,) * 4) is None  # a miss, recomputed by the caller
