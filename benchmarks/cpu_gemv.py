"""Native small-batch GEMV (kernels/gemv.py) vs Baton's torch path, beside the read floor.

    PYTHONPATH=$PWD python benchmarks/cpu_gemv.py [--threads 1] [--rounds 5] [--model smollm2-135m]

1. For SmolLM2-135M's GEMV shapes (qkv 576→960, o 576→576, gate_up 576→3072, down 1536→576,
   lm_head 576→49152) at B = 1 and 8 rows: ms per product and GB/s of weight reads, torch (the
   `Linear` torch storage: (in, out), the big ones as two column halves) vs native ((out, in)),
   each cycling over enough distinct copies (>= 768 MiB) that every read comes from DRAM, not
   the last-level cache. Beside it, the read bandwidth of `x.sum()` over 512 MiB.
2. The whole fp32 decode step of the real model with 1 and 8 sequences (as offline_throughput's
   `batch1_step_ms`), the model's matrices re-laid out torch / native between rounds, and
   "fused" = native storage plus the fused native decode ops (kernels/cpu_decode: rotary + KV
   write + paged attention, add+RMSNorm, SiLU·mul; "native" runs them as torch ops), beside the
   read-bandwidth floor (weight bytes / `x.sum()` GB/s of the same round); then a 512-token
   prefill on both storages (it stays on torch's GEMM: a check that the layout costs it nothing).

Variants alternate A B A B within each round and the medians over rounds are printed with the
load average, since the machine is shared and noisy. Needs the model in the model cache for 2.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from baton.models.linear import Linear
from kernels import gemv as native

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536),
          "lm_head": (49152, 576)}
SPLIT = {"gate_up", "down", "lm_head"}  # stored as two column halves on the torch path


def read_gbps(x: torch.Tensor, reps: int = 3) -> float:
    """GB/s of `x.sum()` (one read pass), best of `reps`."""
    x.sum()
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t)
    return x.numel() * x.element_size() / best / 1e9


def _sweep_ms(linears: list[Linear], x: torch.Tensor, min_s: float = 0.05) -> float:
    """ms per product over a cycle through `linears` (each a distinct matrix)."""
    for lin in linears[:2]:
        lin(x)
    n, t = 0, time.perf_counter()
    while True:
        for lin in linears:
            lin(x)
        n += len(linears)
        if time.perf_counter() - t >= min_s:
            return (time.perf_counter() - t) / n * 1e3


def bench_shapes(rounds: int, bw_buf: torch.Tensor) -> None:
    print(f"{'shape':8s} {'B':>2s} {'torch ms':>9s} {'GB/s':>5s} {'native ms':>9s} {'GB/s':>5s}"
          f" {'speedup':>7s} {'x.sum GB/s':>10s}")
    for name, (out, k) in SHAPES.items():
        copies = max(2, -(-(768 << 20) // (out * k * 4)))
        base = [torch.randn(out, k) * 0.05 for _ in range(copies)]
        layouts = {"torch": [Linear(w, False, name in SPLIT) for w in base],
                   "native": [Linear(w, True) for w in base]}
        gb = out * k * 4 / 1e9
        for b in (1, 8):
            x = torch.randn(b, k)
            ms = {"torch": [], "native": []}
            bws = []
            for _ in range(rounds):
                for variant in ("torch", "native"):
                    ms[variant].append(_sweep_ms(layouts[variant], x))
                bws.append(read_gbps(bw_buf))
            t, nv = statistics.median(ms["torch"]), statistics.median(ms["native"])
            print(f"{name:8s} {b:2d} {t:9.3f} {gb / t * 1e3:5.1f} {nv:9.3f} {gb / nv * 1e3:5.1f}"
                  f" {t / nv:6.2f}x {statistics.median(bws):10.1f}", flush=True)
        del base, layouts


def relayout(model, use_native: bool) -> None:
    """Re-store every matrix of a `DecoderModel` for the native or the torch path."""
    def redo(lin: Linear, split: bool) -> Linear:
        return Linear(lin.matrix().contiguous(), use_native, split)

    for layer in model.layers:
        layer.qkv, layer.o = redo(layer.qkv, False), redo(layer.o, False)
        layer.gate_up, layer.down = redo(layer.gate_up, True), redo(layer.down, True)
    model.lm_head = redo(model.lm_head, True)


def _decode_steps_ms(engine, tag: str, seqs: int, context: int, steps: int,
                     clock=time.perf_counter) -> float:
    """Median ms of a decode step of `seqs` sequences, after prefilling `context` tokens each,
    timed by `clock` (wall, or this thread's CPU time: robust to other processes' load when
    torch runs one thread)."""
    from baton import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=steps + 2, ignore_eos=True)
    ids = [f"{tag}-{i}" for i in range(seqs)]
    for i, rid in enumerate(ids):
        engine.add_request(rid, [100 + (i * 7919 + j) % 20000 for j in range(context)], params)
    while any(engine.get_request(r).num_computed_tokens < context for r in ids):
        engine.step()
    times = []
    while engine.has_unfinished_requests():
        t = clock()
        engine.step()
        times.append(clock() - t)
    return 1000 * statistics.median(times[2:-2])


def bench_step(model: str, rounds: int, context: int, seqs: int, bw_buf: torch.Tensor,
               clock=time.perf_counter) -> None:
    """The decode step of `seqs` sequences, torch vs native storage vs native + fused decode
    ops, alternated A B C C B A, beside the read floor."""
    from baton import LLM

    llm = LLM(model, dtype="float32", kv_cache_memory_bytes=256 << 20)
    m = llm.engine.model
    weight_bytes = sum(lin.nbytes for lin in m.linears())
    fused_ok = m.fused_decode
    ms = {"torch": [], "native": []} | ({"fused": []} if fused_ok else {})
    floors = []
    for r in range(rounds):
        for variant in (list(ms) if r % 2 == 0 else list(ms)[::-1]):
            relayout(m, variant != "torch")
            m.fused_decode = variant == "fused"
            ms[variant].append(_decode_steps_ms(llm.engine, f"{variant}{r}", seqs, context, 24,
                                                clock))
        floors.append(weight_bytes / (read_gbps(bw_buf) * 1e9) * 1e3)
    floor = statistics.median(floors)
    print(f"\n{seqs}-sequence fp32 decode step, {model}, context {context}, "
          f"{weight_bytes / 1e6:.0f} MB of weights, medians of {rounds} rounds:")
    for variant, values in ms.items():
        step = statistics.median(values)
        print(f"  {variant:6s} {step:6.1f} ms  ({step / floor:.2f}x the read floor; rounds "
              + " ".join(f"{v:.1f}" for v in values) + ")")
    print(f"  read floor {floor:5.1f} ms (x.sum over 512 MiB, same rounds, wall time)", flush=True)
    m.fused_decode = fused_ok


def bench_prefill(model: str, rounds: int, tokens: int) -> None:
    """A `tokens`-token prefill (one request, distinct tokens every time so nothing is
    prefix-cached), torch vs native storage: prefill runs torch's GEMM on either layout."""
    from baton import LLM, SamplingParams

    llm = LLM(model, dtype="float32", kv_cache_memory_bytes=256 << 20)
    e = llm.engine
    ms = {"torch": [], "native": []}
    for r in range(rounds):
        for n, variant in enumerate(("torch", "native")):
            relayout(e.model, variant == "native")
            prompt = [100 + (r * 31 + n * 5003 + j * 7919) % 20000 for j in range(tokens)]
            e.add_request(f"p{variant}{r}", prompt,
                          SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
            t = time.perf_counter()
            while e.has_unfinished_requests():
                e.step()
            ms[variant].append((time.perf_counter() - t) * 1e3)
    print(f"\n{tokens}-token prefill (+ 1 sampled token), medians of {rounds} rounds:")
    for variant, values in ms.items():
        print(f"  {variant:6s} {statistics.median(values):7.0f} ms (rounds "
              + " ".join(f"{v:.0f}" for v in values) + ")", flush=True)


def add_common_args(p: argparse.ArgumentParser) -> None:
    """Flags shared with benchmarks/cpu_gemv_bf16.py."""
    p.add_argument("--threads", type=int, default=1, help="torch threads (workers default: 1)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--context", type=int, default=256, help="prompt tokens before decoding")
    p.add_argument("--clock", choices=["wall", "cpu"], default=None,
                   help="decode-step clock (default: cpu, i.e. thread CPU time, at 1 thread; "
                        "wall otherwise)")


def start(args: argparse.Namespace) -> str:
    """Set torch's threads, build the native extension (SystemExit if it cannot be built);
    returns the clock's name."""
    torch.set_num_threads(args.threads)
    if not native.gemv_available():
        raise SystemExit("the native GEMV extension did not build here (see the log)")
    return args.clock or ("cpu" if args.threads == 1 else "wall")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_common_args(p)
    p.add_argument("--seqs", default="1,8", help="decode batch sizes of the whole-step part")
    p.add_argument("--prefill", type=int, default=512, help="prefill tokens (0: skip)")
    p.add_argument("--skip-step", action="store_true", help="only the per-shape table")
    args = p.parse_args()
    clock = start(args)
    print(f"threads {torch.get_num_threads()}, load average {os.getloadavg()}, "
          f"cpu capability {torch.backends.cpu.get_cpu_capability()}", flush=True)
    bw_buf = torch.ones(128 << 20, dtype=torch.float32)  # 512 MiB
    bench_shapes(args.rounds, bw_buf)
    if not args.skip_step:
        print(f"decode-step clock: {clock}")
        for seqs in map(int, args.seqs.split(",")):
            bench_step(args.model, args.rounds, args.context, seqs, bw_buf,
                       time.thread_time if clock == "cpu" else time.perf_counter)
        if args.prefill:
            bench_prefill(args.model, min(args.rounds, 3), args.prefill)
    print(f"load average at the end {os.getloadavg()}")


if __name__ == "__main__":
    main()
