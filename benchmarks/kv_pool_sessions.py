"""Microbench: BlockPool allocate + release per block, without sessions and with many
sessions (the eviction order by session class, free_lists.py). Prints µs per block; asserts
nothing. `python benchmarks/kv_pool_sessions.py [--pool MODULE]` (MODULE: another BlockPool,
e.g. a copy of an older block_pool.py, for a before/after comparison).
"""
from __future__ import annotations

import argparse
import importlib
import time


def bench(pool_cls, num_blocks: int, sessions: int, rounds: int, batch: int) -> float:
    """µs per block for `rounds` × (allocate `batch` cached blocks, release them), blocks
    released round-robin over `sessions` sessions (0: none)."""
    pool = pool_cls(num_blocks)
    hint = None
    if sessions:
        from baton.session_hints import SessionHint
        hints = [SessionHint(f"s{i}", ttl_s=float(i % 7)) for i in range(sessions)]
    h = 0
    start = time.perf_counter()
    for r in range(rounds):
        blocks = pool.allocate(batch)
        for b in blocks:
            h += 1
            pool.cache(b, h, (h,))
        if sessions:
            hint = hints[r % sessions]
            pool.release(blocks, hint)
        else:
            pool.release(blocks)
    return (time.perf_counter() - start) / (rounds * batch) * 1e6


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pool", default="baton.engine.block_pool")
    p.add_argument("--blocks", type=int, default=8192)
    p.add_argument("--rounds", type=int, default=20000)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--repeat", type=int, default=5)
    a = p.parse_args()
    cls = importlib.import_module(a.pool).BlockPool
    for sessions in (0, 1, 64, 1024):
        try:  # best of `repeat` runs: the machine is shared
            us = min(bench(cls, a.blocks, sessions, a.rounds, a.batch) for _ in range(a.repeat))
        except TypeError:  # a pool without sessions
            continue
        print(f"{a.pool} sessions={sessions:5d}: {us:.2f} µs per block (allocate + cache + "
              f"release, pool {a.blocks}, batch {a.batch}, best of {a.repeat})")


if __name__ == "__main__":
    main()
