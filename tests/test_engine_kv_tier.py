"""A session's prefix evicted from a tiny pool comes back from the host or disk tier: fp32
greedy outputs equal transformers' reference, bad tier files are recomputed, aborts leave
pools and tiers whole."""
import os
import random

import pytest

from baton import LLM, SamplingParams
from baton.block_hash import hash_block_tokens
from tests.reference import hf_greedy

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
BS = 4
BLOCK_BYTES = 2 * 2 * BS * 2 * 16 * 4  # tiny Llama: 2 layers, K/V, 2 kv heads, head size 16


def _ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 300) for _ in range(n)]


def _llm(folder, **tier) -> LLM:
    # fp32 named: turns are compared with transformers' fp32 model and BLOCK_BYTES is fp32's
    return LLM(str(folder), block_size=BS, num_blocks=24, dtype="float32", **tier)


def _session(llm: LLM, folder):
    """Turn 1, two unrelated prompts that evict all of it from the pool, then turn 2
    (turn 1's prompt + answer + more). Returns turn 2's output; checks every output."""
    turn1 = _ids(30, seed=1)
    (out1,) = llm.generate([turn1], GREEDY)
    assert out1.outputs[0].token_ids == hf_greedy(folder, turn1, 8)
    for seed in (2, 3):
        llm.generate([_ids(60, seed)], GREEDY)
    turn2 = turn1 + out1.outputs[0].token_ids + _ids(6, seed=4)
    first = hash_block_tokens(turn2, BS)[0]
    assert llm.engine.kv.pool.cached.get(first) is None  # turn 1 left the pool
    (out2,) = llm.generate([turn2], GREEDY)
    assert out2.outputs[0].token_ids == hf_greedy(folder, turn2, 8)
    return out2


def _whole(llm: LLM) -> None:
    kv = llm.engine.kv
    assert kv.num_free_blocks == kv.num_blocks and not kv.requests
    assert all(b.ref_cnt == 0 for b in kv.pool.blocks)
    tier = kv.tier
    tier.flush()
    if tier.host is not None:
        assert len(tier.host.index) + len(tier.host.free_slots) == tier.host.num_slots
        assert len(set(s for s, _ in tier.host.index.values()) | set(tier.host.free_slots)) \
            == tier.host.num_slots
    if tier.disk is not None:
        files = os.listdir(tier.disk.dir)
        assert sorted(files) == sorted(f"{h:016x}.kv" for h in tier.disk.index)
        assert tier.disk.used_bytes == sum(
            os.path.getsize(os.path.join(tier.disk.dir, f)) for f in files)


def test_turn_two_from_the_host_tier_matches_reference(tiny_llama):
    llm = _llm(tiny_llama, kv_host_tier_bytes=64 * BLOCK_BYTES)
    out2 = _session(llm, tiny_llama)
    plain = _session(_llm(tiny_llama), tiny_llama)  # no tier: turn 2 recomputed
    assert plain.num_cached_tokens == 0
    assert out2.outputs[0].token_ids == plain.outputs[0].token_ids
    assert out2.num_cached_tokens >= 36  # turn 1's 9 full blocks (prompt + answer)
    (host,) = llm.engine.counts().kv_tiers
    assert host.tier == "host" and host.totals.hits >= 9 and host.totals.loaded_blocks >= 9
    assert host.totals.loaded_bytes == host.totals.loaded_blocks * BLOCK_BYTES
    _whole(llm)


def test_turn_two_from_the_disk_tier_matches_reference(tiny_llama, tmp_path):
    llm = _llm(tiny_llama, kv_host_tier_bytes=BLOCK_BYTES, kv_disk_tier_dir=str(tmp_path))
    out2 = _session(llm, tiny_llama)
    assert out2.num_cached_tokens >= 36
    host, disk = llm.engine.counts().kv_tiers
    assert disk.totals.hits >= 8 and disk.totals.loaded_blocks == disk.totals.hits
    assert disk.totals.saved_bytes > 0 and disk.totals.load_seconds > 0
    _whole(llm)


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_a_corrupt_tier_file_is_recomputed_with_the_right_output(tiny_llama, tmp_path,
                                                                 damage):
    llm = _llm(tiny_llama, kv_disk_tier_dir=str(tmp_path))  # disk tier only
    turn1 = _ids(30, seed=1)
    llm.generate([turn1], GREEDY)
    for seed in (2, 3):
        llm.generate([_ids(60, seed)], GREEDY)
    disk = llm.engine.kv.tier.disk
    third = hash_block_tokens(turn1, BS)[2]
    with open(disk.path(third), "r+b") as f:
        if damage == "flip":
            f.seek(-100, os.SEEK_END)
            byte = f.read(1)
            f.seek(-100, os.SEEK_END)
            f.write(bytes([byte[0] ^ 0x40]))
        else:
            f.truncate(os.path.getsize(disk.path(third)) // 2)
    turn2 = turn1 + _ids(6, seed=4)
    (out2,) = llm.generate([turn2], GREEDY)
    assert out2.outputs[0].token_ids == hf_greedy(tiny_llama, turn2, 8)
    assert out2.num_cached_tokens == 2 * BS  # blocks 0 and 1 loaded; 2 on recomputed
    counts = llm.engine.counts()
    assert counts.kv_tier_recomputed_blocks == 1 and counts.kv_tiers[0].totals.dropped_blocks == 1
    _whole(llm)


def test_aborts_leave_pool_and_tiers_whole(tiny_llama, tmp_path):
    llm = _llm(tiny_llama, kv_host_tier_bytes=4 * BLOCK_BYTES, kv_disk_tier_dir=str(tmp_path))
    eng = llm.engine
    for seed in range(5):
        eng.add_request(f"r{seed}", _ids(40, seed), GREEDY)
        for _ in range(2):
            eng.step()
        if seed % 2:
            eng.abort_request(f"r{seed}")
    while eng.has_unfinished_requests():
        eng.step()
    for rid in list(eng.requests):
        eng.abort_request(rid)
    _whole(llm)
    again = _ids(40, 0)
    (out,) = llm.generate([again], GREEDY)
    assert out.outputs[0].token_ids == hf_greedy(tiny_llama, again, 8)
    _whole(llm)
