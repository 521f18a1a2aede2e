"""gpu_check section `tiers`: the KV host and disk tiers under a pool on the device.

    tiered: bf16 engine on ctx.device, a 16-block pool over a host tier (pinned host memory)
            over a disk tier: turn 1; two long prompts evict it from the pool (device →
            host, and with a 4-block host tier on to disk); turn 2 = turn 1 + its answer +
            more: its prefix comes back (host → device; disk → host staging → device)
    pooled: the same engine config with a pool large enough to keep turn 1, no tier
    turn 2's tokens are equal (both compute turn 2's suffix over the same prefix KV bytes),
    with a 64-block host tier loading from host, with a 4-block one from disk.
"""
from __future__ import annotations

import json
import random

from gpu_check import FAIL, PASS, log
from gpu_check_engine import BLOCK_SIZE, make_engine, model_folder, run_engine

MODEL = "smollm2-135m"
NEW_TOKENS = 12


def _session(engine, vocab: int) -> tuple[list[int], list[int]]:
    """Turn 1, two evicting prompts, turn 2 (one at a time): (turn 1's, turn 2's tokens)."""
    rng = random.Random(5)

    def ids(n: int) -> list[int]:
        return [rng.randrange(3, vocab) for _ in range(n)]

    turn1 = ids(60)
    [out1], _, _ = run_engine(engine, [turn1], NEW_TOKENS)
    for _ in range(2):
        run_engine(engine, [ids(200)], NEW_TOKENS)
    turn2 = turn1 + out1 + ids(20)
    [out2], _, _ = run_engine(engine, [turn2], NEW_TOKENS)
    return out1, out2


def _tiered(ctx, folder, host_blocks: int, block_bytes: int):
    """turn 2's tokens through a 16-block pool over `host_blocks` of host tier over disk,
    and the tier's (saved, loaded) blocks per tier."""
    tier_dir = ctx.workdir / f"kv-disk-tier-{host_blocks}"
    engine = make_engine(ctx, folder, 16, dtype="bfloat16",
                         kv_host_tier_bytes=host_blocks * block_bytes,
                         kv_disk_tier_dir=str(tier_dir), kv_disk_tier_bytes=256 << 20)
    got = _session(engine, engine.vocab_size)
    counts = {c.tier: c.totals for c in engine.kv.tier.counts()}
    pinned = engine.kv.tier.host.store.is_pinned()
    return got, {t: c.saved_blocks for t, c in counts.items()}, \
        {t: c.loaded_blocks for t, c in counts.items()}, pinned


def section_tiers(ctx) -> tuple[str, str]:
    from baton.engine.kv_budget import block_bytes_of

    folder = model_folder(ctx, MODEL)
    block_bytes = block_bytes_of(json.loads((folder / "config.json").read_text()), BLOCK_SIZE, 2)
    pooled = make_engine(ctx, folder, 64, dtype="bfloat16")
    want = _session(pooled, pooled.vocab_size)
    del pooled
    rows, bad = {}, []
    # 64 host blocks hold all that is evicted (turn 2 loads from host); 4 spill it to disk
    for host_blocks, source in ((64, "host"), (4, "disk")):
        got, saved, loaded, pinned = _tiered(ctx, folder, host_blocks, block_bytes)
        rows[f"host_{host_blocks}"] = {"equal": got == want, "saved_blocks": saved,
                                       "loaded_blocks": loaded, "host_pinned": pinned}
        log(f"{host_blocks}-block host tier: turn 2 {'equal' if got == want else 'DIFFERENT'}; "
            f"blocks saved {saved}, loaded back {loaded}; host tier pinned {pinned}")
        if got != want:
            bad.append(f"turn 2 from the {source} tier differs from turn 2 from the pool")
        elif not loaded.get(source):
            bad.append(f"turn 2 loaded nothing from the {source} tier")
    ctx.report["tiers"] = rows
    if bad:
        return FAIL, bad[0]
    return PASS, (f"bf16 KV on {ctx.device} to the host tier and the disk tier and back: turn 2 "
                  "== turn 2 from the pool, from each")
