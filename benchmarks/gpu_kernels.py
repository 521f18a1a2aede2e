"""One-shot check and timing of Baton's compiled Triton kernels on a CUDA machine.

    python benchmarks/gpu_kernels.py [--dtype bfloat16] [--batch 64] [--context 2048]

1. Checks every `<name>_triton` launcher against its torch reference on SmolLM2-shaped inputs
   (3 KV heads, 9 query heads, head size 64, block size 16, 30 layers) over a block-major cache:
   write_kv and pack/unpack bit-exact; attention, add_rms_norm and silu_mul by
   `max|kernel - ref_fp32| <= 2 * max|torch - ref_fp32| + atol`.
2. Times paged decode attention (64 sequences x 2k context) and pack/unpack_blocks, and prints
   their achieved GB/s next to a measured `torch` device-to-device copy bandwidth.

Exits with status 1 and a message where there is no CUDA device. `--smoke` runs the same code
on tiny shapes through Triton's CPU interpreter (to test this script without a GPU).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

NUM_LAYERS, NUM_KV_HEADS, NUM_Q_HEADS, HEAD_SIZE, BLOCK_SIZE = 30, 3, 9, 64, 16
ATOL = {"float32": 1e-5, "bfloat16": 2.0**-8, "float16": 2.0**-11}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dtype", default="bfloat16", choices=sorted(ATOL))
    p.add_argument("--batch", type=int, default=64, help="decode sequences")
    p.add_argument("--context", type=int, default=2048, help="tokens per decode sequence")
    p.add_argument("--pack-blocks", type=int, default=1024, help="blocks per pack/unpack call")
    p.add_argument("--tokens", type=int, default=4096, help="tokens per write_kv call")
    p.add_argument("--smoke", action="store_true", help="tiny shapes on CPU via TRITON_INTERPRET")
    args = p.parse_args()
    if args.smoke:
        args.batch, args.context, args.pack_blocks, args.tokens = 3, 40, 3, 20
    return args


def bench_ms(fn, device) -> float:
    """Median milliseconds per call."""
    if device.type == "cuda":
        import triton.testing

        return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")
    fn()
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


def check_close(name, kernel, same_dtype, ref_fp32, atol) -> None:
    err = (kernel.float() - ref_fp32).abs().max().item()
    base = (same_dtype.float() - ref_fp32).abs().max().item()
    bound = 2 * base + atol * max(1.0, ref_fp32.abs().max().item())
    status = "ok" if err <= bound else "FAIL"
    print(f"  {name:<24} max err {err:.3g}  (bound {bound:.3g})  {status}")
    if status != "ok":
        raise SystemExit(f"{name}: Triton output differs from the reference")


def check_exact(name, ok: bool) -> None:
    print(f"  {name:<24} bit-exact {'ok' if ok else 'FAIL'}")
    if not ok:
        raise SystemExit(f"{name}: Triton output differs from the reference")


def block_tables_for(lens, device, torch, fill=-1):
    """Shuffled distinct blocks per sequence; unused entries = fill. Returns (tables, num_blocks)."""
    used = [-(-n // BLOCK_SIZE) for n in lens]
    num_blocks = sum(used) + 1
    ids = torch.randperm(num_blocks, device=device, dtype=torch.int32)
    tables = torch.full((len(lens), max(used)), fill, dtype=torch.int32, device=device)
    start = 0
    for row, n in enumerate(used):
        tables[row, :n] = ids[start : start + n]
        start += n
    return tables, num_blocks


def layer_caches(num_blocks, dtype, device, torch):
    """A two-layer block-major cache; returns the strided key/value views of layer 1."""
    kv = torch.randn(num_blocks, 2, 2, BLOCK_SIZE, NUM_KV_HEADS, HEAD_SIZE, device=device).to(dtype)
    return kv[:, 1, 0], kv[:, 1, 1]


def f32(*tensors):
    return [t.float() for t in tensors]


def check_write_kv(kernels, torch, dtype, device, num_tokens):
    key_cache, value_cache = layer_caches(num_tokens // BLOCK_SIZE + 8, dtype, device, torch)
    slots = torch.randperm(key_cache.shape[0] * BLOCK_SIZE, device=device)[:num_tokens]
    slots[::7] = -1
    key, value = (torch.randn(num_tokens, NUM_KV_HEADS, HEAD_SIZE, device=device).to(dtype) for _ in range(2))
    kc, vc = key_cache.clone(), value_cache.clone()
    kernels.write_kv_triton(key, value, key_cache, value_cache, slots)
    kernels.write_kv_ref(key, value, kc, vc, slots)
    check_exact("write_kv", torch.equal(key_cache, kc) and torch.equal(value_cache, vc))


def check_decode(kernels, torch, dtype, device, args, atol):
    lens = torch.randint(1, args.context + 1, (args.batch,)).tolist()
    lens[:3] = [1, BLOCK_SIZE, args.context]
    tables, num_blocks = block_tables_for(lens, device, torch)
    key_cache, value_cache = layer_caches(num_blocks, dtype, device, torch)
    query = torch.randn(args.batch, NUM_Q_HEADS, HEAD_SIZE, device=device).to(dtype)
    context_lens = torch.tensor(lens, dtype=torch.int32, device=device)
    call = (tables, context_lens, HEAD_SIZE**-0.5)
    out = kernels.paged_decode_attention_triton(query, key_cache, value_cache, *call)
    same = kernels.paged_decode_attention_ref(query, key_cache, value_cache, *call)
    ref_fp32 = kernels.paged_decode_attention_ref(*f32(query, key_cache, value_cache), *call)
    check_close("paged_decode_attention", out, same, ref_fp32, atol)


def check_prefill(kernels, torch, dtype, device, args, atol):
    ctx = args.context
    seq_lens, q_lens = [ctx, ctx, ctx * 3 // 4, 17, 1], [ctx, ctx // 4, 1, 17, 1]
    tables, num_blocks = block_tables_for(seq_lens, device, torch)
    key_cache, value_cache = layer_caches(num_blocks, dtype, device, torch)
    query = torch.randn(sum(q_lens), NUM_Q_HEADS, HEAD_SIZE, device=device).to(dtype)
    qsl = torch.tensor([0] + q_lens, device=device).cumsum(0).to(torch.int32)
    call = (tables, qsl, torch.tensor(seq_lens, dtype=torch.int32, device=device), HEAD_SIZE**-0.5)
    out = kernels.prefill_attention_triton(query, key_cache, value_cache, *call)
    same = kernels.prefill_attention_ref(query, key_cache, value_cache, *call)
    ref_fp32 = kernels.prefill_attention_ref(*f32(query, key_cache, value_cache), *call)
    check_close("prefill_attention", out, same, ref_fp32, atol)


def full_cache(num_blocks, dtype, device, torch):
    return torch.randn(num_blocks, NUM_LAYERS, 2, BLOCK_SIZE, NUM_KV_HEADS, HEAD_SIZE, device=device).to(dtype)


def check_norm_act(kernels, torch, dtype, device, rows, atol):
    """add_rms_norm (SmolLM2's hidden 576, Llama-1B's 2048) and silu_mul (intermediate 1536,
    8192) on `rows` rows: the in-place residual sum bit-exact (one rounding of an elementwise
    add), the outputs within check_close's bound of the fp32 reference (the same formulas on
    the inputs widened to fp32, no intermediate rounding)."""
    g = torch.Generator(device="cpu").manual_seed(3)
    for hidden in (576, 2048):
        h, r = (torch.randn(rows, hidden, generator=g).to(device=device, dtype=dtype) for _ in "hr")
        w = (1 + 0.1 * torch.randn(hidden, generator=g)).to(device=device, dtype=dtype)
        h_kernel, h_torch = h.clone(), h.clone()
        out = kernels.add_rms_norm_triton(h_kernel, r, w, 1e-5)
        same = kernels.add_rms_norm_ref(h_torch, r, w, 1e-5)
        check_exact(f"add_rms_norm h {hidden}", torch.equal(h_kernel, h_torch))
        hf = h_torch.float()
        ref = w.float() * hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + 1e-5)
        check_close(f"add_rms_norm {hidden}", out, same, ref, atol)
    for inter in (1536, 8192):
        x = (4 * torch.randn(rows, 2 * inter, generator=g)).to(device=device, dtype=dtype)
        gate, up = x.float().chunk(2, dim=1)
        check_close(f"silu_mul {inter}", kernels.silu_mul_triton(x), kernels.silu_mul_ref(x),
                    torch.nn.functional.silu(gate) * up, atol)


def check_block_copy(kernels, torch, dtype, device, args):
    src, dst = (full_cache(2 * args.pack_blocks, dtype, device, torch) for _ in range(2))
    ids = torch.randperm(src.shape[0], device=device)[: args.pack_blocks]
    buffer = kernels.pack_blocks_triton(src, ids)
    check_exact("pack_blocks", torch.equal(buffer, kernels.pack_blocks_ref(src, ids)))
    expected = dst.clone()
    kernels.unpack_blocks_ref(buffer, expected, ids.flip(0))
    kernels.unpack_blocks_triton(buffer, dst, ids.flip(0))
    check_exact("unpack_blocks", torch.equal(dst, expected))


def copy_bandwidth(torch, device) -> float:
    """GB/s of a plain device copy, counting read + write."""
    numel = (1 << 28) if device.type == "cuda" else (1 << 20)  # 1 GiB of fp32 on GPU
    src = torch.randn(numel, device=device)
    dst = torch.empty_like(src)
    return 2 * src.nbytes / bench_ms(lambda: dst.copy_(src), device) / 1e6


def time_decode(kernels, torch, dtype, device, args):
    lens = [args.context] * args.batch
    tables, num_blocks = block_tables_for(lens, device, torch)
    key_cache, value_cache = layer_caches(num_blocks, dtype, device, torch)
    query = torch.randn(args.batch, NUM_Q_HEADS, HEAD_SIZE, device=device).to(dtype)
    context_lens = torch.tensor(lens, dtype=torch.int32, device=device)
    call = (query, key_cache, value_cache, tables, context_lens, HEAD_SIZE**-0.5)
    kv_bytes = 2 * sum(lens) * NUM_KV_HEADS * HEAD_SIZE * key_cache.element_size()
    runs = (("triton", kernels.paged_decode_attention_triton), ("torch ref", kernels.paged_decode_attention_ref))
    for name, fn in runs:
        ms = bench_ms(lambda: fn(*call), device)
        print(f"  decode {name:<10} {args.batch} x {args.context} tokens  {ms * 1e3:9.1f} us  "
              f"{kv_bytes / ms / 1e6:8.1f} GB/s (K+V read)")


def time_block_copy(kernels, torch, dtype, device, args):
    cache = full_cache(2 * args.pack_blocks, dtype, device, torch)
    ids = torch.randperm(cache.shape[0], device=device)[: args.pack_blocks]
    buffer = kernels.pack_blocks_triton(cache, ids)
    moved = 2 * buffer.nbytes  # read + write
    runs = (
        ("pack triton", lambda: kernels.pack_blocks_triton(cache, ids, out=buffer)),
        ("pack torch ref", lambda: kernels.pack_blocks_ref(cache, ids, out=buffer)),
        ("unpack triton", lambda: kernels.unpack_blocks_triton(buffer, cache, ids)),
    )
    for name, fn in runs:
        ms = bench_ms(fn, device)
        print(f"  {name:<15} {args.pack_blocks} blocks ({buffer.nbytes / 2**20:.0f} MiB)  {ms * 1e3:9.1f} us  "
              f"{moved / ms / 1e6:8.1f} GB/s (read + write)")


def main() -> None:
    args = parse_args()
    if args.smoke:
        os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported
    import torch

    if not args.smoke and not torch.cuda.is_available():
        raise SystemExit("benchmarks/gpu_kernels.py needs a CUDA GPU (torch.cuda.is_available() is False); "
                         "use --smoke to run it on CPU through the Triton interpreter")
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    import kernels

    device = torch.device("cpu" if args.smoke else "cuda")
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(0)
    print(f"device {torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu (interpreter)'}, {args.dtype}, "
          f"Hq={NUM_Q_HEADS} Hkv={NUM_KV_HEADS} D={HEAD_SIZE} block_size={BLOCK_SIZE} layers={NUM_LAYERS}")
    print("correctness (Triton vs torch reference):")
    check_write_kv(kernels, torch, dtype, device, args.tokens)
    check_decode(kernels, torch, dtype, device, args, ATOL[args.dtype])
    check_prefill(kernels, torch, dtype, device, args, ATOL[args.dtype])
    check_block_copy(kernels, torch, dtype, device, args)
    check_norm_act(kernels, torch, dtype, device, args.batch, ATOL[args.dtype])
    print("timing (median):")
    print(f"  torch copy_ bandwidth {copy_bandwidth(torch, device):8.1f} GB/s (read + write)")
    time_decode(kernels, torch, dtype, device, args)
    time_block_copy(kernels, torch, dtype, device, args)


if __name__ == "__main__":
    main()
