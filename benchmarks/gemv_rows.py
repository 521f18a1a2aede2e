"""Where the native GEMV stops beating torch's GEMM as a step's token rows grow (kernels/gemv.py's
`MAX_ROWS` / `MAX_ROWS_AVX2`: speculative verify steps carry 1 + k rows per sequence, short
prefill chunks a few dozen).

    python benchmarks/gemv_rows.py [--model smollm2-135m] [--rows 1,4,8,16,20,36,64,96,128]
        [--rounds 3] [--threads N] [--dtype float32|bfloat16]

Every matrix of the model's decoder (qkv, o, gate_up, down per layer, then lm_head; shapes
from the model folder's config.json, random fp32 values: only the time is measured) is
multiplied by one x of B rows, native (`gemv_native`, w [out, in]) then torch (`x @ w.t()`,
what `gemv` falls back to), alternating per round; prints the best time of each over the
rounds and torch / native (> 1: native is faster); bf16 on a CPU with AMX also the AMX GEMV
(`kernels.gemv_amx`, up to its 32 rows) and native / amx. The weights (~540 MB for SmolLM2-135M)
exceed the caches, so each product streams its matrix from DRAM as in a real step. Run on a
quiet machine.
"""
from __future__ import annotations

import argparse
import json
import time

import torch

from baton.config import parse_dtype
from baton.models.registry import resolve_model
from kernels import gemv as g
from kernels import gemv_amx


def matrices(model: str, dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    """The decoder's (out, in) matrices of `dtype` in step order, random values."""
    cfg = json.loads((resolve_model(model) / "config.json").read_text())
    h, inter = cfg["hidden_size"], cfg["intermediate_size"]
    d = cfg.get("head_dim", h // cfg["num_attention_heads"])
    qkv = (cfg["num_attention_heads"] + 2 * cfg["num_key_value_heads"]) * d
    layer = [(qkv, h), (h, cfg["num_attention_heads"] * d), (2 * inter, h), (h, inter)]
    shapes = layer * cfg["num_hidden_layers"] + [(cfg["vocab_size"], h)]
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(o, i, generator=gen).to(dtype) for o, i in shapes]


def one_pass_ms(ws: list[torch.Tensor], rows: int, native: bool,
                packed: list[torch.Tensor] | None = None) -> float:
    """One pass over ws: the native kernel, torch's (native False), or with `packed` (the
    matrices as `kernels.gemv_amx.pack` lays them out) the AMX one."""
    xs = {w.shape[1]: torch.randn(rows, w.shape[1]).to(ws[0].dtype) for w in ws}
    t0 = time.perf_counter()
    for i, w in enumerate(ws):
        x = xs[w.shape[1]]
        if packed is not None:
            gemv_amx.gemv_amx(x, packed[i], w.shape[0])
        else:
            g.gemv_native(x, w) if native else x @ w.t()
    return (time.perf_counter() - t0) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--rows", default="1,4,8,16,20,36,64,96,128")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: all)")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    if not g.gemv_available():
        raise SystemExit("the native GEMV did not build here: nothing to compare")
    ws = matrices(a.model, parse_dtype(a.dtype))
    print(f"threads {torch.get_num_threads()}, {a.dtype}, "
          f"{sum(w.numel() * w.element_size() for w in ws) / 1e6:.0f} MB of weights, "
          f"max_rows() here = {g.max_rows(ws[0].dtype)}")
    packed = ([gemv_amx.pack(w) for w in ws] if ws[0].dtype == torch.bfloat16
              and gemv_amx.available() else None)
    for rows in (int(r) for r in a.rows.split(",")):
        one_pass_ms(ws[:2], rows, True), one_pass_ms(ws[:2], rows, False)  # warm both paths
        nat, ref, amx = [], [], []
        use_amx = packed is not None and rows <= gemv_amx.MAX_ROWS
        for _ in range(a.rounds):
            nat.append(one_pass_ms(ws, rows, True))
            ref.append(one_pass_ms(ws, rows, False))
            if use_amx:
                amx.append(one_pass_ms(ws, rows, True, packed))
        tail = f"  amx {min(amx):7.1f} ms  native/amx {min(nat) / min(amx):5.2f}" if amx else ""
        print(f"rows {rows:4d}  native {min(nat):7.1f} ms  torch {min(ref):7.1f} ms  "
              f"torch/native {min(ref) / min(nat):5.2f}{tail}", flush=True)


if __name__ == "__main__":
    main()
