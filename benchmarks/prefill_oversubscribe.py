"""Why `--pin share` re-reads the load between layers (baton/worker/cpu_share.py): a prefill
step on two threads beside another busy process on a two-core host, against one thread.

    python benchmarks/prefill_oversubscribe.py [--prompts 177,409,660] [--rounds 2]

In-process engine (SmolLM2-135M, fp32, shortest_first, prefill target 256 tokens), the given
cold prompts queued together, 1 output token each; per configuration the seconds from queueing
to each prompt's first token. Configurations, alternating by round:
  1 thread          what a busy pair of workers each gets
  2 threads         a worker alone on the host
  2 threads + hog   two threads while a second process decodes on one thread (a batch-4
                    GEMV over the 49,152 x 576 lm_head, in a loop): three threads on two
                    cores, what a prefill step started alone ran as once the decode worker
                    got work, before the per-layer re-read
Prints the load average before each measurement. Nothing is asserted: read the ratios.
"""
from __future__ import annotations

import argparse
import os
import random
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
HOG = ("import torch, time\ntorch.set_num_threads(1)\na = torch.randn(4, 576)\n"
       "w = torch.randn(49152, 576)\nt = time.time()\n"
       "while time.time() - t < 120: a @ w.T\n")


def first_tokens(threads: int, sizes: list[int]) -> dict[int, float]:
    """Seconds from queueing the prompts (random token ids) together to each one's first
    token, keyed by prompt length, on `threads` torch threads."""
    import torch

    from baton import SamplingParams
    torch.set_num_threads(threads)
    engine = _llm().engine
    rng = random.Random(time.monotonic_ns())  # fresh prompts: no prefix-cache hits
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    t0 = time.perf_counter()
    for n in sizes:
        engine.add_request(f"r{n}-{time.monotonic_ns()}", [rng.randrange(1000, 40000)
                                                           for _ in range(n)], params)
    done: dict[int, float] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            n = int(out.request_id[1:].split("-")[0])
            done.setdefault(n, time.perf_counter() - t0)
    return done


_LLM = None


def _llm():
    global _LLM
    if _LLM is None:
        from baton import LLM
        _LLM = LLM(policy="shortest_first", prefill_target_tokens=256, num_blocks=512,
                   max_num_seqs=8)
    return _LLM


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--prompts", default="177,409,660", help="prompt lengths, queued together")
    p.add_argument("--rounds", type=int, default=2)
    a = p.parse_args()
    sizes = [int(x) for x in a.prompts.split(",")]
    sys.path.insert(0, str(REPO))
    _llm()
    first_tokens(2, [64])  # warm-up
    for r in range(a.rounds):
        order = ["1", "2", "2+hog"] if r % 2 == 0 else ["2+hog", "2", "1"]
        for cfg in order:
            load = os.getloadavg()[0]
            hog = None
            if cfg == "2+hog":
                hog = subprocess.Popen([sys.executable, "-c", HOG])
                time.sleep(1.0)
            try:
                done = first_tokens(1 if cfg == "1" else 2, sizes)
            finally:
                if hog is not None:
                    hog.kill()
                    hog.wait()
            cells = "  ".join(f"{n}: {done[n]:.2f} s" for n in sizes)
            print(f"round {r + 1}  {cfg:>6} thread(s)  {cells}   (load {load:.2f})", flush=True)


if __name__ == "__main__":
    main()
