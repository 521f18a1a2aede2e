"""bf16 batch-1 decode step against the bf16 weight-read floor and the fp32 path, in one run.

    PYTHONPATH=$PWD python benchmarks/cpu_gemv_bf16.py [--threads 1] [--rounds 5] [--model M]

1. Per SmolLM2 GEMV shape (qkv 576→960, o 576→576, gate_up 576→3072, down 1536→576, lm_head
   576→49152), B = 1: ms per product and GB/s of weight reads of the native bf16 GEMV (the
   variant `kernels.gemv` picks here: AVX512_BF16, AVX2 or scalar) and the native fp32 one, each
   cycling over enough distinct copies (>= 768 MiB) that every read comes from DRAM.
2. The whole batch-1 decode step of the model (default: the real SmolLM2-135M from the model
   cache) in bf16 and in fp32, alternated A B B A over rounds, each beside its read floor: one
   read pass over the same weight bytes the step reads (every matrix of `model.linears()`,
   viewed as fp32 words and summed; subnormal words flushed so they cost nothing), timed with the
   same clock in the same round. Printed: medians over rounds, the step / floor ratio (issue 24's
   target: bf16 <= 1.3x), and the bf16 / fp32 step ratio.

The machine is shared and noisy: the load average is printed at the start and the end, with the
CPU model and its bf16 flags. Nothing here asserts; the numbers are for BENCHMARKS.md.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from baton.dtypes import cpu_flags
from baton.models.linear import Linear
from benchmarks.cpu_gemv import SHAPES, _decode_steps_ms, _sweep_ms, add_common_args, start
from kernels import cpu_decode
from kernels import gemv as native


def cpu_line() -> str:
    """CPU model name and the flags that choose the kernels."""
    name = "?"
    try:
        name = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo")
                    if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    keep = ("avx2", "fma", "avx512f", "avx512bw", "avx512_bf16", "amx_bf16")
    have = " ".join(f for f in keep if f in cpu_flags()) or f"none of {keep}"
    return f"{name}; flags: {have}"


def read_pass_ms(weights: list[torch.Tensor], clock, reps: int = 3) -> float:
    """Best of `reps` single read passes over every tensor's bytes (viewed as fp32 words), ms."""
    words = [w.reshape(-1).view(torch.float32) for w in weights]
    torch.set_flush_denormal(True)  # bf16 pairs may read as fp32 subnormals
    try:
        best = float("inf")
        for _ in range(reps + 1):  # the first pass warms the code path
            t = clock()
            for w in words:
                w.sum()
            best = min(best, clock() - t)
    finally:
        torch.set_flush_denormal(False)
    return best * 1e3


def bench_shapes(rounds: int) -> None:
    print(f"{'shape':8s} {'bf16 ms':>8s} {'GB/s':>5s} {'fp32 ms':>8s} {'GB/s':>5s}"
          "  (B = 1, native)")
    for name, (out, k) in SHAPES.items():
        ms, gbs = {}, {}
        for dtype in (torch.bfloat16, torch.float32):
            nbytes = out * k * torch.empty(0, dtype=dtype).element_size()
            copies = max(2, -(-(768 << 20) // nbytes))
            linears = [Linear((torch.randn(out, k) * 0.05).to(dtype), True) for _ in range(copies)]
            x = torch.randn(1, k).to(dtype)
            ms[dtype] = statistics.median(_sweep_ms(linears, x) for _ in range(rounds))
            gbs[dtype] = nbytes / ms[dtype] / 1e6
            del linears
        print(f"{name:8s} {ms[torch.bfloat16]:8.3f} {gbs[torch.bfloat16]:5.1f} "
              f"{ms[torch.float32]:8.3f} {gbs[torch.float32]:5.1f}", flush=True)


def bench_step(model: str, rounds: int, context: int, clock) -> None:
    from baton import LLM

    llms = {d: LLM(model, dtype=d, kv_cache_memory_bytes=128 << 20)
            for d in ("bfloat16", "float32")}
    weights = {d: [lin.weight for lin in llm.engine.model.linears()] for d, llm in llms.items()}
    steps = {d: [] for d in llms}
    floors = {d: [] for d in llms}
    for r in range(rounds):
        for d in (list(llms) if r % 2 == 0 else list(llms)[::-1]):
            steps[d].append(_decode_steps_ms(llms[d].engine, f"{d}{r}", 1, context, 24, clock))
            floors[d].append(read_pass_ms(weights[d], clock))
    print(f"\nbatch-1 decode step, {model}, context {context}, medians of {rounds} rounds:")
    for d, llm in llms.items():
        m = llm.engine.model
        step, floor = statistics.median(steps[d]), statistics.median(floors[d])
        mb = sum(w.numel() * w.element_size() for w in weights[d]) / 1e6
        print(f"  {d:9s} step {step:6.1f} ms  read floor {floor:5.1f} ms ({mb:.0f} MB)  "
              f"{step / floor:.2f}x the floor  [native GEMV {m.native_gemv}, "
              f"AMX GEMV {m.amx_gemv}, "
              f"fused decode ops {m.fused_decode}]  rounds "
              + " ".join(f"{v:.1f}" for v in steps[d]))
    ratio = statistics.median(steps["bfloat16"]) / statistics.median(steps["float32"])
    print(f"  bf16 / fp32 step: {ratio:.2f}", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_common_args(p)
    p.add_argument("--skip-shapes", action="store_true", help="only the whole-step part")
    args = p.parse_args()
    clock_name = start(args)
    clock = time.thread_time if clock_name == "cpu" else time.perf_counter
    ext = native._load()
    print(f"CPU: {cpu_line()}\nthreads {torch.get_num_threads()}, clock {clock_name}, load average "
          f"{os.getloadavg()}, bf16 GEMV variant "
          f"{'AVX512_BF16' if ext.has_avx512_bf16() else 'AVX2 or scalar'} (AMX where the model "
          f"says so below), fused decode ops "
          f"{'AVX-512F' if cpu_decode.fast_available() else 'scalar (bf16 only; no AVX-512F)'}",
          flush=True)
    if not args.skip_shapes:
        bench_shapes(args.rounds)
    bench_step(args.model, args.rounds, args.context, clock)
    print(f"load average at the end {os.getloadavg()}")


if __name__ == "__main__":
    main()
