"""gpu_check sections `kernels` and `decode_bw`: Triton kernels against their references, and
paged decode attention against the device's measured copy bandwidth.

`kernels` reuses benchmarks/gpu_kernels.py's checks (SmolLM2 heads: 9 query / 3 KV, head
size 64, block size 16): write_kv and pack/unpack bit-exact, attention, add_rms_norm and
silu_mul within 2·|torch − ref_fp32| + atol of the fp32 reference.

`decode_bw` times `paged_decode_attention_triton` on Llama-3.2-1B's heads (32 query / 8 KV,
head size 64, bf16) over a two-layer block-major cache (layer 1's strided views, as in the
engine), at 4K context x 64 sequences, 32K x 8 and 32K x 1 (the last shows what split-KV
would buy: one program per (sequence, KV head) is 8 programs for the whole GPU):

    achieved GB/s = K+V bytes read (2 · Σ context · Hkv · D · 2 B) / median time
    ratio         = achieved / torch copy_ GB/s (read + write of 1 GiB, same run)
"""
from __future__ import annotations

import importlib
from types import SimpleNamespace

import torch

import gpu_kernels as gk
from gpu_check import FAIL, PASS, log

LLAMA_HQ, LLAMA_HKV, HEAD = 32, 8, 64


def _compiled() -> bool:
    """True when the @triton.jit functions are compiled ones (not the CPU interpreter's)."""
    pda = importlib.import_module("kernels.paged_decode_attention")  # the package re-exports
    return type(pda._paged_decode_kernel).__name__ == "JITFunction"  # a function of that name


def section_kernels(ctx) -> tuple[str, str]:
    import kernels

    compiled = _compiled()
    log(f"triton kernels {'compiled' if compiled else 'interpreted (TRITON_INTERPRET=1)'}")
    if ctx.device.type == "cuda" and not compiled:
        return FAIL, "on CUDA but the kernels are interpreted: unset TRITON_INTERPRET"
    if ctx.dry_run:
        args, dtypes = SimpleNamespace(batch=3, context=40, pack_blocks=3, tokens=20), ["float32"]
    else:
        args = SimpleNamespace(batch=64, context=2048, pack_blocks=256, tokens=4096)
        dtypes = ["bfloat16", "float32"]
    torch.manual_seed(0)
    for name in dtypes:
        dtype, atol = getattr(torch, name), gk.ATOL[name]
        log(f"{name}: batch {args.batch}, context {args.context}")
        gk.check_write_kv(kernels, torch, dtype, ctx.device, args.tokens)
        gk.check_decode(kernels, torch, dtype, ctx.device, args, atol)
        gk.check_prefill(kernels, torch, dtype, ctx.device, args, atol)
        gk.check_block_copy(kernels, torch, dtype, ctx.device, args)
        gk.check_norm_act(kernels, torch, dtype, ctx.device, args.batch, atol)
    mode = "compiled" if compiled else "interpreted"
    return PASS, (f"write_kv, decode, prefill, pack/unpack, add_rms_norm, silu_mul == reference "
                  f"({mode}; {'/'.join(dtypes)})")


def _decode_case(kernels, ctx, dtype, context: int, batch: int, copy_gbs: float) -> dict:
    lens = [context] * batch
    tables, num_blocks = gk.block_tables_for(lens, ctx.device, torch)
    kv = torch.randn(num_blocks, 2, 2, gk.BLOCK_SIZE, LLAMA_HKV, HEAD, device=ctx.device).to(dtype)
    key_cache, value_cache = kv[:, 1, 0], kv[:, 1, 1]
    query = torch.randn(batch, LLAMA_HQ, HEAD, device=ctx.device).to(dtype)
    context_lens = torch.tensor(lens, dtype=torch.int32, device=ctx.device)
    call = (tables, context_lens, HEAD ** -0.5)
    out = kernels.paged_decode_attention_triton(query, key_cache, value_cache, *call)
    same = kernels.paged_decode_attention_ref(query, key_cache, value_cache, *call)
    ref = kernels.paged_decode_attention_ref(query.float(), key_cache.float(),
                                             value_cache.float(), *call)
    err = (out.float() - ref).abs().max().item()
    bound = 2 * (same.float() - ref).abs().max().item() + gk.ATOL[str(dtype)[6:]] * max(
        1.0, ref.abs().max().item())
    del same, ref
    ms = gk.bench_ms(lambda: kernels.paged_decode_attention_triton(
        query, key_cache, value_cache, *call), ctx.device)
    kv_bytes = 2 * sum(lens) * LLAMA_HKV * HEAD * kv.element_size()
    gbs = kv_bytes / ms / 1e6
    row = {"context": context, "batch": batch, "us": ms * 1e3, "gb_s": gbs,
           "ratio_to_copy": gbs / copy_gbs, "max_err": err, "bound": bound, "ok": err <= bound}
    log(f"ctx {context:>6} x {batch:<3} {ms * 1e3:9.1f} us  {gbs:8.1f} GB/s K+V  "
        f"{row['ratio_to_copy']:5.2f} of copy  err {err:.2e} (bound {bound:.2e})"
        f"{'' if row['ok'] else '  FAIL'}")
    return row


def _ctx_name(n: int) -> str:
    return f"{n // 1024}K" if n >= 1024 and n % 1024 == 0 else str(n)


def section_decode_bw(ctx) -> tuple[str, str]:
    import kernels

    if ctx.dry_run:
        dtype, cases = torch.float32, [(64, 2), (256, 1)]
    else:
        dtype, cases = torch.bfloat16, [(4096, 64), (32768, 8), (32768, 1)]
    torch.manual_seed(0)
    copy_gbs = gk.copy_bandwidth(torch, ctx.device)
    log(f"torch copy_ {copy_gbs:.1f} GB/s (read + write)"
        f"{' (CPU, interpreter: not a GPU number)' if ctx.dry_run else ''}")
    rows = [_decode_case(kernels, ctx, dtype, c, b, copy_gbs) for c, b in cases]
    ctx.report["decode_bw"] = {"copy_gb_s": copy_gbs, "dtype": str(dtype), "cases": rows}
    if ctx.device.type == "cuda":
        torch.cuda.empty_cache()
    bad = [r for r in rows if not r["ok"]]
    if bad:
        return FAIL, f"decode attention differs from the reference at ctx {bad[0]['context']}"
    summary = ", ".join(f"{_ctx_name(r['context'])}x{r['batch']} {r['ratio_to_copy']:.2f}"
                        for r in rows)
    return PASS, f"achieved / copy bandwidth: {summary} (copy {copy_gbs:.0f} GB/s)"
