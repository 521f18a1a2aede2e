"""What a verify step costs against a plain decode step (issue 26: "the verify-step cost vs a
plain step recorded").

    python benchmarks/spec_verify_cost.py [--model smollm2-135m] [--ks 1,2,4,8]
        [--batches 1,4] [--prompt-tokens 500] [--new-tokens 49] [--rounds 2]

For each round, batch and k (plain first, then each k; one process, fp32, the machine's
threads): the offline engine (`baton.LLM`) prefills `batch` fresh random prompts of
`--prompt-tokens`, then times its decode steps one by one (the median over about
`--new-tokens` / (k + 1) steps). With speculation on, every decode row carries k drafted
tokens that are all accepted (`synthetic_acceptance=(1.0,)`, the BENCHMARK ONLY mode: the
drafts are filler, the cost is what is measured; the step budget is off in that mode), so
each step emits k + 1 tokens. (A first version took (generate − prefill-only time) / steps,
which long prompts made meaningless: the prefill dominated.) Prints each point and the median
over rounds of verify step / plain step: the break-even acceptance length on this machine is
that ratio − 1 accepted tokens per step. Run on a quiet machine.
"""
from __future__ import annotations

import argparse
import gc
import os
import random
import time
from statistics import median

from baton import LLM, SamplingParams


def step_ms(llm: LLM, rng: random.Random, batch: int, length: int, new: int,
            per_step: int) -> float:
    """Median milliseconds of a decode step emitting `per_step` tokens per row: `batch` fresh
    random prompts are prefilled, then `new // per_step` decode-only steps are timed one by
    one (engine.step(); drafting, forward, verification and bookkeeping included)."""
    eng = llm.engine
    # room for the decode steps rows take while the others still prefill (chunked), so every
    # row is still running when they all decode
    params = SamplingParams(max_tokens=(new // per_step + 2) * per_step + batch * length // 16,
                            temperature=0.0, ignore_eos=True)
    for _ in range(batch):
        eng.add_request(f"r{rng.random()}", [rng.randrange(100, 20000) for _ in range(length)],
                        params)
    sched = eng.scheduler
    while sum(r.num_tokens - r.num_computed_tokens == 1 for r in sched.running) < batch:
        if not eng.has_unfinished_requests():
            raise RuntimeError("a row finished before every row decoded: raise max_tokens")
        eng.step()  # prefill (chunked) until every row decodes
    eng.step()
    times = []
    for _ in range(max(2, new // per_step)):
        t0 = time.perf_counter()
        eng.step()
        times.append(time.perf_counter() - t0)
    while eng.has_unfinished_requests():
        eng.step()
    return median(times) * 1e3


def engine(model: str, k: int) -> LLM:
    spec = None if k == 0 else {"method": "suffix", "num_speculative_tokens": k,
                                "synthetic_acceptance": (1.0,)}
    return LLM(model, dtype="float32", kv_cache_memory_bytes=1 << 30, speculative_config=spec)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--ks", default="1,2,4,8")
    ap.add_argument("--batches", default="1,4")
    ap.add_argument("--prompt-tokens", type=int, default=500)
    ap.add_argument("--new-tokens", type=int, default=49)
    ap.add_argument("--rounds", type=int, default=2)
    a = ap.parse_args()
    ks = [0] + [int(k) for k in a.ks.split(",")]
    batches = [int(b) for b in a.batches.split(",")]
    print(f"load {os.getloadavg()[0]:.2f}, {len(os.sched_getaffinity(0))} cpus")
    rng = random.Random(0)
    seen: dict[tuple[int, int], list[float]] = {}
    for _ in range(a.rounds):
        for k in ks:
            llm = engine(a.model, k)
            for b in batches:
                ms = step_ms(llm, rng, b, a.prompt_tokens, a.new_tokens, k + 1)
                seen.setdefault((b, k), []).append(ms)
                print(f"batch {b} k {k}: {ms:.1f} ms per step", flush=True)
            del llm
            gc.collect()
    for b in batches:
        plain = median(seen[(b, 0)])
        for k in ks[1:]:
            x = median(seen[(b, k)]) / plain
            print(f"batch {b}: k={k} verify step {median(seen[(b, k)]):.1f} ms = {x:.2f}x a "
                  f"plain step ({plain:.1f} ms); break-even {x - 1:.2f} accepted per step")


if __name__ == "__main__":
    main()
