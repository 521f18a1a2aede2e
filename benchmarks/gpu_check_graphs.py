"""gpu_check sections `graphs` and `decode_floor`: the engine's CUDA-graph decode steps
(baton/engine/cuda_graphs.py) against its eager steps, and a batch-1 decode step against the
device's memory-read floor.

    graphs        each fp32 engine of the `engine` section: one decode step of 1, 3 (padded
                  to 4) and 8 rows at context 512 through `runner.graphs.run` against the
                  eager `runner.decode_step` on the same inputs (same kernels: equal argmax,
                  max |diff| reported), and both steps' times. Dry-run: the same padding
                  and static buffers through DecodeGraphs(capture=False) on CPU with the
                  CUDA attention path, against the CPU path; SKIP (nothing is captured).
    decode_floor  each bf16 engine of the `bf16` section: the batch-1 decode step's time
                  (graph replay on CUDA) against
                      floor = bytes of every weight matrix a step reads / read bandwidth,
                  the read bandwidth being one `x.sum()` pass over a bf16 tensor of 1 GiB
                  (dry-run: 64 MiB) measured in the same run. Reported, not judged.
                  On CUDA also an A/B in the same run: that step with the residual add +
                  RMSNorm and SiLU·mul as torch ops (kernels/norm_act.py off) against the
                  fused one, each side's ms and kernel launches per step.

Both overwrite the engines' KV pools with random values (they are the last to use them).
"""
from __future__ import annotations

import random
import statistics
import time

import torch

from gpu_check import FAIL, PASS, SKIP, log
from gpu_check_engine import BLOCK_SIZE


def decode_inputs(batch: int, context: int, vocab: int, seed: int = 0) -> tuple:
    """Host lists of one decode step (`batch` sequences at position context-1, each in its
    own blocks 0.., 1.., ...): (input_ids, positions, slot_mapping, block_tables, lens)."""
    width, p = -(-context // BLOCK_SIZE), context - 1
    tables = [list(range(i * width, (i + 1) * width)) for i in range(batch)]
    rng = random.Random(seed)
    return ([rng.randrange(3, vocab) for _ in range(batch)], [p] * batch,
            [t[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for t in tables], tables,
            [context] * batch)


def eager_step(runner, inputs):
    """The same step as `runner.graphs.run(*inputs)`, launched op by op."""
    from baton.models.decoder import AttentionMetadata

    ids, pos, slots, tables, lens = inputs
    dev = runner.device
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, device=dev), num_decode_tokens=len(ids),
        decode_block_tables=torch.tensor(tables, dtype=torch.int32, device=dev),
        decode_context_lens=torch.tensor(lens, dtype=torch.int32, device=dev))
    return runner.decode_step(torch.tensor(ids, device=dev), torch.tensor(pos, device=dev), meta)


def time_ms(fn, iters: int, device) -> float:
    """Median milliseconds per call over `iters` calls (after one untimed call)."""
    fn()
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


@torch.inference_mode()
def _graph_case(ctx, name: str, engine, batch: int, context: int) -> tuple[bool, str]:
    from baton.engine.cuda_graphs import DecodeGraphs

    runner = engine.runner
    inputs = decode_inputs(batch, context, engine.vocab_size, seed=batch)
    if ctx.device.type != "cuda":  # dry-run: the padding on CPU, CUDA attention path
        graphs = DecodeGraphs(runner.decode_step, runner.device, 8,
                              engine.max_model_len // BLOCK_SIZE + 1, capture=False)
        runner.model.cpu_attention = False
        try:
            graphed = graphs.run(*inputs).clone()
        finally:
            runner.model.cpu_attention = True
        eager = eager_step(runner, inputs)
        good = torch.equal(graphed.argmax(-1), eager.argmax(-1)) and \
            torch.allclose(graphed, eager, atol=1e-4)
        return good, (f"{name} batch {batch}: padded static step (CUDA attention path) vs CPU "
                      f"path: max diff {(graphed - eager).abs().max().item():.1e}")
    if runner.graphs is None:
        return False, f"{name}: the engine captured no CUDA graphs"
    graphed = runner.graphs.run(*inputs).clone()
    eager = eager_step(runner, inputs)
    same = torch.equal(graphed.argmax(-1), eager.argmax(-1))
    diff = (graphed - eager).abs().max().item()
    eager_ms = time_ms(lambda: eager_step(runner, inputs), 30, ctx.device)
    graph_ms = time_ms(lambda: runner.graphs.run(*inputs), 30, ctx.device)
    ctx.report.setdefault("graphs", {})[f"{name}/b{batch}"] = {
        "eager_ms": eager_ms, "graph_ms": graph_ms, "max_diff": diff, "same_argmax": same,
        "padded_to": runner.graphs.padded_size(batch)}
    return same, (f"{name} batch {batch} (graph of {runner.graphs.padded_size(batch)}) ctx "
                  f"{context}: max diff {diff:.2e}, argmax {'equal' if same else 'DIFFERS'}; "
                  f"eager {eager_ms:.2f} ms, graph {graph_ms:.2f} ms ({eager_ms / graph_ms:.1f}x)")


def section_graphs(ctx) -> tuple[str, str]:
    if not ctx.engines:
        return SKIP, "no engine was built (the engine section did not run or failed first)"
    ok, context = True, 64 if ctx.dry_run else 512
    for name, engine in ctx.engines.items():
        engine.runner.kv_cache.normal_()
        for batch in (1, 3, 8):
            good, msg = _graph_case(ctx, name, engine, batch, context)
            log(msg)
            ok = ok and good
    if not ok:
        return FAIL, "a graph-replayed decode step's greedy tokens differ from the eager step's"
    if ctx.device.type != "cuda":
        return SKIP, ("CUDA graphs need a CUDA device (the padded static step ran on CPU "
                      "through the CUDA attention path, == the CPU path)")
    return PASS, "the engine's graphs (batch 1, 3 padded to 4, 8) == eager steps, each model"


def read_gb_s(device, nbytes: int) -> float:
    """GB/s of one `x.sum()` pass over `nbytes` of bf16 (median of 10)."""
    x = torch.ones(nbytes // 2, dtype=torch.bfloat16, device=device)
    ms = time_ms(x.sum, 10, device)
    del x
    return nbytes / ms / 1e6


@torch.inference_mode()
def kernel_profile(step, iters: int, top: int = 8) -> dict:
    """Where a step's device time goes: torch.profiler over `iters` calls of `step` (CUPTI
    sees the kernels of a graph replay too). Returns {"device_us_per_step": Σ kernel time
    / iters, "wall_us_per_step", "top": [(kernel name[:60], µs per step, calls per step)]},
    also logged; {"error": why} when the profiler fails (reported, never a FAIL)."""
    from torch.profiler import ProfilerActivity, profile

    try:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(iters):
                step()
            torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) * 1e6 / iters
        kernels: dict[str, list[float]] = {}
        for e in prof.events():
            if e.device_type == torch.autograd.DeviceType.CUDA:
                k = kernels.setdefault(e.name[:60], [0.0, 0])
                k[0] += e.device_time
                k[1] += 1
    except Exception as e:  # noqa: BLE001 - a profiler that does not run is a report
        log(f"profiler: {type(e).__name__}: {e}")
        return {"error": f"{type(e).__name__}: {e}"}
    device_us = sum(v[0] for v in kernels.values()) / iters
    ranked = sorted(kernels.items(), key=lambda kv: -kv[1][0])[:top]
    rows = [(n, round(v[0] / iters, 1), v[1] / iters) for n, v in ranked]
    log(f"  kernels: {device_us:.0f} us of device time per step, {wall:.0f} us wall "
        f"(profiled), {sum(v[1] for v in kernels.values()) / iters:.0f} launches per step")
    for n, us, calls in rows:
        log(f"    {us:8.1f} us  {calls:5.1f}x  {n}")
    return {"device_us_per_step": device_us, "wall_us_per_step": wall, "top": rows}


def torch_norm_act_ab(runner, inputs, fused_step, device, rounds: int = 5) -> dict:
    """The batch-1 graph step with the residual add + RMSNorm and SiLU·mul as torch ops
    (`fused_norm_act` off: the step before kernels/norm_act.py) against the engine's own
    (fused) graph, alternated A B over `rounds` rounds of 20 steps in one run: medians of
    each side, their ratio, the torch-ops step's kernel profile. Reported, never a FAIL."""
    from baton.engine.cuda_graphs import DecodeGraphs

    model = runner.model
    model.fused_norm_act = False
    try:
        graphs = DecodeGraphs(runner.decode_step, device, 1, runner.graphs.max_blocks)
        graphs.capture()
    finally:
        model.fused_norm_act = True
    torch_step = lambda: graphs.run(*inputs)  # noqa: E731
    fused_ms, torch_ms = [], []
    for _ in range(rounds):
        fused_ms.append(time_ms(fused_step, 20, device))
        torch_ms.append(time_ms(torch_step, 20, device))
    out = {"fused_ms": statistics.median(fused_ms), "torch_ops_ms": statistics.median(torch_ms)}
    out["fused_over_torch"] = out["fused_ms"] / out["torch_ops_ms"]
    log(f"  A/B: fused norm/act {out['fused_ms']:.3f} ms vs torch ops {out['torch_ops_ms']:.3f} "
        f"ms per step ({out['fused_over_torch']:.2f}x); the torch-ops step:")
    out["kernels"] = kernel_profile(torch_step, 20)
    return out


def section_decode_floor(ctx) -> tuple[str, str]:
    engines = getattr(ctx, "engines_bf16", {})
    if not engines:
        return SKIP, "no bf16 engine was built (the bf16 section did not run or failed first)"
    gb_s = read_gb_s(ctx.device, (64 if ctx.dry_run else 1024) << 20)
    log(f"read bandwidth (bf16 sum): {gb_s:.1f} GB/s")
    rows, summary = {}, []
    for name, engine in engines.items():
        runner = engine.runner
        runner.kv_cache.normal_()
        weights = sum(lin.nbytes for lin in runner.model.linears())
        inputs = decode_inputs(1, 64 if ctx.dry_run else 512, engine.vocab_size)
        graphed = runner.graphs is not None
        step = (lambda: runner.graphs.run(*inputs)) if graphed else \
            (lambda: eager_step(runner, inputs))
        step_ms = time_ms(step, 10 if ctx.dry_run else 50, ctx.device)
        floor_ms = weights / gb_s / 1e6
        rows[name] = {"weight_bytes": weights, "read_gb_s": gb_s, "step_ms": step_ms,
                      "floor_ms": floor_ms, "ratio": step_ms / floor_ms, "graphs": graphed}
        log(f"{name} bf16 batch 1: {step_ms:.3f} ms/step ({'graph' if graphed else 'eager'}), "
            f"floor {floor_ms:.3f} ms ({weights / 2**20:.1f} MiB at {gb_s:.1f} GB/s): "
            f"{step_ms / floor_ms:.2f}x the floor")
        summary.append(f"{name} {step_ms / floor_ms:.2f}x")
        if ctx.device.type == "cuda":
            rows[name]["kernels"] = kernel_profile(step, 20)
        if graphed and ctx.device.type == "cuda":
            rows[name]["torch_norm_act"] = torch_norm_act_ab(runner, inputs, step, ctx.device)
    ctx.report["decode_floor"] = rows
    where = "CPU (dry-run: not a GPU number)" if ctx.dry_run else str(ctx.device)
    return PASS, f"batch-1 bf16 step / read floor on {where}: {', '.join(summary)}"
