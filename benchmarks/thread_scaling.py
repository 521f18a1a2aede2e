"""How prefill and decode scale with torch threads on this host (the P/D cost model's shared-core
pricing, baton/pd_cost.py; issue 28).

    python benchmarks/thread_scaling.py [--model smollm2-135m] [--prompt-tokens 500]
        [--new-tokens 64] [--rounds 2]

For each round, all the cores' threads then half of them (alternating, one process), batch
1 and 4: the offline engine (`baton.LLM`, fp32) prefills fresh random prompts for one token
(prompt tokens/s), then prefills fresh ones again and decodes `--new-tokens` (ms per decode
step = (that time − the prefill-only time) / (new tokens − 1)). Greedy, ignore_eos. Prints
one line per point and the two ratios the cost model uses (medians over the rounds): prefill
rate on all threads over half of them, and the decode step on half over all (the fraction of
its rate a decode worker loses to a busy neighbour = 1 − all/half). Run on a quiet machine.
"""
from __future__ import annotations

import argparse
import os
import random
import time
from statistics import median

import torch

from baton import LLM, SamplingParams


def prompts(rng: random.Random, n: int, length: int) -> list[list[int]]:
    return [[rng.randrange(100, 20000) for _ in range(length)] for _ in range(n)]


def point(llm: LLM, rng: random.Random, batch: int, length: int, new: int) -> tuple[float, float]:
    """(prompt tokens/s, ms per decode step) at the current thread count."""
    one = SamplingParams(max_tokens=1, temperature=0.0)
    t0 = time.perf_counter()
    llm.generate(prompts(rng, batch, length), one)
    prefill_s = time.perf_counter() - t0
    full = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)
    t0 = time.perf_counter()
    llm.generate(prompts(rng, batch, length), full)
    total_s = time.perf_counter() - t0
    return batch * length / prefill_s, (total_s - prefill_s) / (new - 1) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--prompt-tokens", type=int, default=500)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    a = ap.parse_args()
    cpus = len(os.sched_getaffinity(0))
    print(f"load {os.getloadavg()[0]:.2f}, {cpus} cpus, torch {torch.__version__}")
    llm = LLM(a.model, dtype="float32", kv_cache_memory_bytes=1 << 30)
    rng = random.Random(0)
    seen: dict[tuple[int, int], list[tuple[float, float]]] = {}
    for _ in range(a.rounds):
        for threads in (cpus, max(1, cpus // 2)):
            torch.set_num_threads(threads)
            for batch in (1, 4):
                rate, step = point(llm, rng, batch, a.prompt_tokens, a.new_tokens)
                seen.setdefault((threads, batch), []).append((rate, step))
                print(f"threads {threads} batch {batch}: prefill {rate:.0f} tokens/s, "
                      f"decode step {step:.1f} ms", flush=True)
    half = max(1, cpus // 2)
    for batch in (1, 4):
        full, part = seen[(cpus, batch)], seen[(half, batch)]
        rate_x = median(r for r, _ in full) / median(r for r, _ in part)
        step_x = median(s for _, s in part) / median(s for _, s in full)
        print(f"batch {batch}: prefill {rate_x:.2f}x faster on {cpus} threads than {half}; "
              f"decode step {step_x:.2f}x slower on {half} (rate lost {1 - 1 / step_x:.2f})")


if __name__ == "__main__":
    main()
