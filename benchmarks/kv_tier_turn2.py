"""A session's turn 2 after its turn-1 KV left the pool: recomputed, or loaded from the host
or the disk tier. One variant per process (a fresh engine each).

    python benchmarks/kv_tier_turn2.py none|host|disk [--model smollm2-135m] [--turn1 1024]

Turn 1 (random token ids, 1 output token) runs, two unrelated prompts of --filler tokens
evict it from a pool of --num-blocks blocks, then turn 2 = turn 1 + 64 new tokens is timed
(1 output token: about its TTFT). Prints turn 1's time (the same prompt computed: the
machine's speed at that moment), turn 2's, its num_cached_tokens, the blocks and seconds
each tier loaded, the first token (equal across variants) and the load average.
"""
from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from baton import LLM, SamplingParams  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("variant", choices=["none", "host", "disk"])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--turn1", type=int, default=1024)
    p.add_argument("--filler", type=int, default=1500)
    p.add_argument("--num-blocks", type=int, default=128)
    p.add_argument("--dir", default=tempfile.gettempdir())
    a = p.parse_args()
    rng = random.Random(0)
    ids = lambda n: [rng.randrange(100, 30000) for _ in range(n)]  # noqa: E731
    turn1, fillers, extra = ids(a.turn1), [ids(a.filler), ids(a.filler)], ids(64)
    tier = {"none": {}, "host": {"kv_host_tier_bytes": 1 << 30},
            "disk": {"kv_disk_tier_dir": a.dir}}[a.variant]
    llm = LLM(a.model, num_blocks=a.num_blocks, block_size=16, **tier)
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    start = time.perf_counter()
    llm.generate([turn1], params)
    turn1_s = time.perf_counter() - start
    for prompt in fillers:
        llm.generate([prompt], params)
    start = time.perf_counter()
    (out,) = llm.generate([turn1 + extra], params)
    seconds = time.perf_counter() - start
    loads = [(c.tier, c.totals.loaded_blocks, round(c.totals.load_seconds, 4))
             for c in llm.engine.counts().kv_tiers]
    print(f"{a.variant}: turn 1 ({len(turn1)} tokens, computed) {turn1_s * 1e3:.0f} ms; "
          f"turn 2 ({len(turn1) + len(extra)} tokens) {seconds * 1e3:.0f} ms, "
          f"cached {out.num_cached_tokens}, loaded {loads}, first token "
          f"{out.outputs[0].token_ids}, load average {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
