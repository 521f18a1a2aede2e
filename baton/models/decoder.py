"""Baton's own forward pass for Llama-family decoders over the paged KV cache.

Covers Llama, Mistral (no sliding window), Qwen2 (q/k/v bias) and Qwen3 (per-head q/k RMS
norm), tied or untied embeddings, GQA. Config, rotary tables and activation come from
transformers so the numerics match its reference implementation; the weights are re-laid out
for speed: q/k/v fused into one matrix, gate/up into another, each a `baton.models.linear.Linear`.
fp32 and bf16 on CPU keep every matrix (out, in) for the native small-batch GEMV (`kernels.gemv`:
decode steps of <= 16 tokens stream the weights at the memory-read floor, bf16 with fp32 sums;
prefill keeps torch's GEMM, oneDNN/AMX for bf16); fp16, or a machine where the extension does not
build, keep the torch layout ((in, out), the big matrices as two column halves, see linear.py).

A CPU step of decode tokens only, with the native extension built (fp32: on an AVX-512 CPU;
bf16: on any, see `kernels.cpu_decode.use_fused`) and no per-head q/k norm, runs each layer's
rotary + KV write + paged attention as one native call (`kernels.cpu_decode`, K/V read in place
through the block table; `kernels.cpu_verify` when some decode row carries drafted tokens),
and each residual add + RMSNorm and the SiLU·mul as one call each, in fp32 or bf16 (a bf16 KV
cache read in place, fp32 softmax; see kernels/cpu_decode.py). Other CPU steps first build a
`kernels.paged_cpu.PagedAttentionPlan` (every cache index derived once, not per layer; in bf16
with those native ops, each layer's rotary + KV write is one native call too, `kernels.cpu_rope`,
with the torch ops' bits, and the prefill attention `kernels.cpu_prefill`'s): after a
layer's GEMVs have streamed megabytes of weights through the caches, each small torch op costs
40–100 µs here, so the per-layer op count is what the decode step time is made of beyond the
weight reads. On CUDA attention and the KV write are the `kernels` Triton launchers, and in
bf16/fp16 each residual add + RMSNorm and the SiLU·mul one Triton kernel (kernels/norm_act.py:
a graph-replayed decode step is bound by its kernel count).

One step runs over a flat batch of T tokens from many sequences (decode rows first, then
prefill/chunk rows); `AttentionMetadata` says which tokens belong to whom.
"""
from __future__ import annotations

import functools
import importlib
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file

import kernels
from baton.models.linear import (Linear, bf16_gemm_in_fp32, padded_rows, prepack_fits,
                                 use_amx_gemv, use_native_gemv)
from kernels import cpu_decode, cpu_rope, cpu_verify
from kernels.paged_cpu import PagedAttentionPlan


@dataclass
class AttentionMetadata:
    """Per-step attention inputs (all int tensors on the model's device).

    slot_mapping: [T] int64, cache slot of each new token (block_id * block_size + offset).
    num_decode_tokens: Td; rows [0, Td) are decode rows' tokens, rows [Td, T) prefill chunks.
    decode_block_tables: [Bd, max_blocks] int32; decode_context_lens: [Bd] int32 (incl. new).
    decode_query_start_loc: [Bd+1] int32 when some decode row carries drafted tokens (a
    speculative row: its tokens attend causally), else None (one token a row, Bd = Td);
    decode_max_query_len: the longest decode row (host side: sizes the Triton tile).
    prefill_block_tables: [S, max_blocks] int32; prefill_query_start_loc: [S+1] int32 (offsets
    into the prefill rows); prefill_seq_lens: [S] int32 (tokens in cache incl. the new ones).
    """

    slot_mapping: torch.Tensor
    num_decode_tokens: int
    decode_block_tables: torch.Tensor | None = None
    decode_context_lens: torch.Tensor | None = None
    prefill_block_tables: torch.Tensor | None = None
    prefill_query_start_loc: torch.Tensor | None = None
    prefill_seq_lens: torch.Tensor | None = None
    decode_query_start_loc: torch.Tensor | None = None
    decode_max_query_len: int = 1


@dataclass(frozen=True)
class ModelShape:
    """Dimensions the KV cache and the transfer handshake depend on."""

    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_size: int
    hidden_size: int
    vocab_size: int
    max_position_embeddings: int


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm exactly as transformers' LlamaRMSNorm (fp32 statistics, weight applied last).

    fp32 takes torch's fused `rms_norm` (same formula, one op instead of seven)."""
    if x.dtype == torch.float32:
        return torch.rms_norm(x, weight.shape, weight, eps)
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """Rotary embedding, bit-identical to transformers' `x * cos + rotate_half(x) * sin`.

    x: [T, H, D]; cos, sin_signed: [T, 1, D] where sin_signed's first half is negated, so
    rotate_half(x) * sin = [-x2·s1, x1·s2] = roll(x, D/2) * sin_signed (negation is exact):
    four ops instead of seven (each costs ~40 µs on a cold cache after a GEMV, see
    kernels/paged_cpu.py).
    """
    return x * cos + x.roll(x.shape[-1] // 2, -1) * sin_signed


class Layer:
    """Weights of one decoder layer, fused: qkv [(Hq + 2·Hkv)·D, hidden], o [hidden, Hq·D],
    gate_up [2·I, hidden] (gate rows, then up rows), down [hidden, I], each a `Linear` (given
    (out, in), stored for the GEMV path in use, see baton/models/linear.py). split: the CPU
    column-split storage of the wide products (off on CUDA, where it buys nothing); prepack,
    gemm_fp32, amx: `Linear`'s."""

    def __init__(self, w: dict[str, torch.Tensor], prefix: str, dtype: torch.dtype,
                 native: bool, device: torch.device | None = None, split: bool = True,
                 prepack: bool = False, gemm_fp32: bool = False, amx: bool = False) -> None:
        def get(name: str) -> torch.Tensor | None:
            t = w.get(prefix + name)
            return None if t is None else t.to(device=device, dtype=dtype)

        a = "self_attn."
        self.qkv = Linear(torch.cat([get(a + f"{p}_proj.weight") for p in "qkv"]), native,
                          prepack=prepack, gemm_fp32=gemm_fp32, amx=amx)
        biases = [get(a + f"{p}_proj.bias") for p in "qkv"]
        self.qkv_bias = torch.cat(biases) if biases[0] is not None else None
        self.o = Linear(get(a + "o_proj.weight"), native, prepack=prepack, gemm_fp32=gemm_fp32,
                        amx=amx)
        self.q_norm = get(a + "q_norm.weight")
        self.k_norm = get(a + "k_norm.weight")
        self.gate_up = Linear(torch.cat([get("mlp.gate_proj.weight"), get("mlp.up_proj.weight")]),
                              native, split=split, prepack=prepack, gemm_fp32=gemm_fp32,
                              amx=amx, gate_up=True)
        self.down = Linear(get("mlp.down_proj.weight"), native, split=split, prepack=prepack,
                           gemm_fp32=gemm_fp32, amx=amx)
        self.input_norm = get("input_layernorm.weight")
        self.post_norm = get("post_attention_layernorm.weight")

    def linears(self) -> list[Linear]:
        return [self.qkv, self.o, self.gate_up, self.down]


class DecoderModel:
    """Llama-family causal LM over a paged KV cache.

    kv_cache: [num_blocks, num_layers, 2, block_size, num_kv_heads, head_size] (block-major,
    so one block is contiguous across layers for transfer). Raises UnsupportedModelError-like
    ValueError for configs it cannot run (sliding window shorter than the context).
    device: where the weights and rope tables live; on CUDA the kv_cache must be there too
    and attention runs the Triton kernels, on CPU `kernels.paged_cpu` and the native GEMV.
    """

    def __init__(self, folder: Path, dtype: torch.dtype,
                 device: torch.device | str = "cpu") -> None:
        from transformers import AutoConfig
        from transformers.activations import ACT2FN

        self.config = AutoConfig.from_pretrained(folder)
        cfg = self.config
        self.dtype = dtype
        self.device = torch.device(device)
        cpu = self.device.type == "cpu"
        head_size = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.shape = ModelShape(
            num_layers=cfg.num_hidden_layers, num_heads=cfg.num_attention_heads,
            num_kv_heads=cfg.num_key_value_heads or cfg.num_attention_heads,
            head_size=head_size, hidden_size=cfg.hidden_size, vocab_size=cfg.vocab_size,
            max_position_embeddings=cfg.max_position_embeddings,
        )
        self.eps = cfg.rms_norm_eps
        self.act = ACT2FN[cfg.hidden_act]
        self.scale = head_size ** -0.5
        weights = self._load_weights(folder)
        self.native_gemv = cpu and use_native_gemv(dtype)
        place = {"device": self.device, "dtype": dtype}
        self.embed = weights["model.embed_tokens.weight"].to(**place)
        # bf16 prompt GEMMs from prepacked weights where a second copy fits, in fp32 where the
        # CPU's bf16 products are slow (linear.py)
        layer_bytes = sum(t.numel() for k, t in weights.items() if ".layers." in k) * 2
        prepack = cpu and dtype == torch.bfloat16 and prepack_fits(layer_bytes)
        self.gemm_fp32 = cpu and dtype == torch.bfloat16 and bf16_gemm_in_fp32(layer_bytes)
        if self.gemm_fp32:
            logging.getLogger(__name__).info(
                "bf16 prompt GEMMs run in fp32 on prepacked fp32 weights (this CPU's bf16 "
                "products are slow; BATON_BF16_GEMM=bf16 overrides)")
        # bf16 GEMVs and GEMMs on AMX tiles where the CPU allows them (W re-laid, linear.py)
        self.amx_gemv = (self.native_gemv and dtype == torch.bfloat16
                         and use_amx_gemv(layer_bytes + self.embed.numel() * 2))
        if self.amx_gemv:
            logging.getLogger(__name__).info("bf16 GEMVs and GEMMs run on AMX tiles "
                                             "(BATON_BF16_GEMV=avx512 overrides)")
        self.layers = [Layer(weights, f"model.layers.{i}.", dtype, self.native_gemv,
                             self.device, split=cpu, prepack=prepack, gemm_fp32=self.gemm_fp32,
                             amx=self.amx_gemv)
                       for i in range(cfg.num_hidden_layers)]
        self.norm = weights["model.norm.weight"].to(**place)
        lm_head = weights.get("lm_head.weight")
        tied = lm_head is None or getattr(cfg, "tie_word_embeddings", False)
        # rows may exceed config.vocab_size (padded vocab); a tied one starts from `embed` (the
        # native storage then shares its memory)
        self.lm_head = Linear(self.embed if tied else lm_head.to(**place), self.native_gemv,
                              split=cpu, amx=self.amx_gemv)
        cos, sin_signed = self._rope_tables(cfg, self.shape.max_position_embeddings)
        self._cos, self._sin_signed = cos.to(self.device), sin_signed.to(self.device)
        # the fused CPU decode op (kernels.cpu_decode): fp32 or bf16 with the native extension
        # built; its rotary comes right after the q/k/v projection, so not with Qwen3's per-head
        # q/k norm
        self.fused_decode = (self.native_gemv and cpu_decode.use_fused(dtype)
                             and all(layer.q_norm is None for layer in self.layers))
        # CPU attention through kernels.paged_cpu (indices once per step); False runs the
        # path CUDA takes (the kernels' dispatchers: their torch references on CPU), which
        # tests use to check that path's code without a GPU
        self.cpu_attention = cpu
        self._silu = cfg.hidden_act == "silu"
        # bf16/fp16 on the CUDA path: residual add + RMSNorm and SiLU·mul as one kernel each
        # (kernels/norm_act.py: Triton on CUDA, the torch ops on CPU); fp32 keeps torch's ops,
        # token-exact against transformers. False: the torch ops (an A/B in gpu_check)
        self.fused_norm_act = True
        # called before every layer but the first (worker: cpu_share.py re-reads the other
        # workers' load, so a long prefill step follows a decode worker that starts or stops)
        self.layer_hook: Callable[[], object] | None = None

    @staticmethod
    def _load_weights(folder: Path) -> dict[str, torch.Tensor]:
        weights: dict[str, torch.Tensor] = {}
        for f in sorted(folder.glob("*.safetensors")):
            weights.update(load_file(f))
        return weights

    def _rope_tables(self, cfg, max_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos / sin_signed [max_len, D] from the model's own transformers rotary module (rope
        scaling types included), so positions rotate exactly as in the reference; sin_signed
        has its first half negated (see `_rotate`)."""
        arch = cfg.model_type
        module = importlib.import_module(f"transformers.models.{arch}.modeling_{arch}")
        rotary_cls = next(getattr(module, n) for n in dir(module) if n.endswith("RotaryEmbedding"))
        rotary = rotary_cls(config=cfg)
        pos = torch.arange(max_len)[None]
        cos, sin = rotary(torch.zeros(1, dtype=torch.float32), pos)
        sin = sin[0].clone()
        sin[:, : sin.shape[-1] // 2].neg_()
        return cos[0].to(self.dtype), sin.to(self.dtype)

    # ---- forward -------------------------------------------------------------------------
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                meta: AttentionMetadata, kv_cache: torch.Tensor) -> torch.Tensor:
        """input_ids, positions: [T] int64 → final-normed hidden states [T, hidden]."""
        s = self.shape
        if (self.fused_decode and self.cpu_attention and not kv_cache.is_cuda
                and 0 < meta.num_decode_tokens == len(input_ids)
                and cpu_decode.supported(kv_cache, s.num_heads)
                and (meta.decode_query_start_loc is None
                     or cpu_verify.supported(kv_cache, s.num_heads))):
            return self._forward_decode_cpu(input_ids, positions, meta, kv_cache)
        h = self.embed[input_ids]
        q_width = s.num_heads * s.head_size
        plan = kv_rows = None
        if self.cpu_attention and not kv_cache.is_cuda:  # indices once per step, not per layer
            plan = PagedAttentionPlan(
                tuple(kv_cache.shape), meta.slot_mapping, meta.num_decode_tokens,
                meta.decode_block_tables, meta.decode_context_lens, meta.prefill_block_tables,
                meta.prefill_query_start_loc, meta.prefill_seq_lens, meta.decode_query_start_loc)
            kv_rows = kv_cache.view(-1, s.num_kv_heads, s.head_size)
        # bf16 on CPU with the fused ops: residual add + RMSNorm and SiLU·mul natively (the same
        # roundings as the torch ops, rows over threads), as the decode-only step does
        native = (self.fused_decode and self._silu and h.dtype == torch.bfloat16
                  and not kv_cache.is_cuda)
        # on the CUDA path (plan None) the same two ops as Triton kernels, bf16/fp16 only
        fused = native or (plan is None and self.fused_norm_act and self._silu
                           and h.dtype != torch.float32)
        add_norm, silu_mul = ((cpu_decode.add_rms_norm, cpu_decode.silu_mul) if native
                              else (kernels.add_rms_norm, kernels.silu_mul))
        # the native ops' outputs come with the rows the next bf16 GEMM pads to (linear.py
        # _padded then takes their buffer, not a padded copy)
        pad_rows = padded_rows(len(input_ids), h.dtype) if native else 0
        if pad_rows:
            add_norm = functools.partial(add_norm, rows=pad_rows)
            silu_mul = functools.partial(silu_mul, rows=pad_rows)
        # SiLU·mul inside the gate/up GEMM where it takes this step's rows (linear.py)
        fuse_mlp = native and self.layers[0].gate_up.fuses_silu(len(input_ids), h.dtype)
        if fused:
            x = add_norm(h, None, self.layers[0].input_norm, self.eps)
        native_rope = native and plan is not None
        if native_rope:  # rotary + K/V write in one native call a layer (kernels/cpu_rope.py)
            rope_args = (positions.long().contiguous(), meta.slot_mapping.long().contiguous())
        else:
            cos, sin = self._cos[positions][:, None, :], self._sin_signed[positions][:, None, :]
        for i, layer in enumerate(self.layers):
            if i and self.layer_hook is not None:
                self.layer_hook()
            if not fused:
                x = _rms_norm(h, layer.input_norm, self.eps)
            qkv = layer.qkv(x)
            if layer.qkv_bias is not None:
                qkv += layer.qkv_bias
            if native_rope:
                q = cpu_rope.rope_write(qkv, self._cos, self._sin_signed, rope_args[0], kv_cache,
                                        i, rope_args[1], s.num_heads)
                attn = self._attend_cpu(plan, kv_rows, i, q, pad_rows)
            else:
                # [T, Hq+Hkv, D], [T, Hkv, D]
                qk, v = qkv.view(-1, s.num_heads + 2 * s.num_kv_heads, s.head_size).split(
                    [s.num_heads + s.num_kv_heads, s.num_kv_heads], dim=1)
                if layer.q_norm is not None:
                    qk = torch.cat([_rms_norm(qk[:, :s.num_heads], layer.q_norm, self.eps),
                                    _rms_norm(qk[:, s.num_heads:], layer.k_norm, self.eps)], 1)
                q, k = _rotate(qk, cos, sin).split([s.num_heads, s.num_kv_heads], dim=1)
                if plan is not None:
                    plan.write_kv(kv_rows, i, k, v)
                    attn = self._attend_cpu(plan, kv_rows, i, q)
                else:
                    attn = self._attention(q, k, v, kv_cache[:, i, 0], kv_cache[:, i, 1], meta)
            if fused:
                x = add_norm(h, layer.o(attn.view(-1, q_width)), layer.post_norm, self.eps)
                nxt = self.layers[i + 1].input_norm if i + 1 < len(self.layers) else self.norm
                act = layer.gate_up.silu_mul(x, pad_rows) if fuse_mlp else None
                if act is None:
                    act = silu_mul(layer.gate_up(x))
                x = add_norm(h, layer.down(act), nxt, self.eps)
                continue
            h = h + layer.o(attn.view(-1, q_width))
            x = _rms_norm(h, layer.post_norm, self.eps)
            gate, up = layer.gate_up(x).chunk(2, dim=1)  # [T, I] each
            h = h + layer.down(self.act(gate) * up)
        return x if fused else _rms_norm(h, self.norm, self.eps)

    def _forward_decode_cpu(self, input_ids: torch.Tensor, positions: torch.Tensor,
                            meta: AttentionMetadata, kv_cache: torch.Tensor) -> torch.Tensor:
        """`forward` for a CPU step of decode tokens only: per layer the same math with rotary,
        KV write and attention in one native call (`kernels.cpu_decode.decode_attention`), each
        residual add fused with the RMSNorm after it, and SiLU·mul in one call."""
        s = self.shape
        positions, slots = positions.long().contiguous(), meta.slot_mapping.long().contiguous()
        tables = meta.decode_block_tables.int().contiguous()
        lens = meta.decode_context_lens.int().contiguous()
        rows = meta.decode_query_start_loc  # speculative rows: kernels.cpu_verify's op
        if rows is not None:
            rows = rows.int().contiguous()
        h = self.embed[input_ids]  # a fresh tensor: updated in place by add_rms_norm below
        x = cpu_decode.add_rms_norm(h, None, self.layers[0].input_norm, self.eps)
        fuse_mlp = self._silu and self.layers[0].gate_up.fuses_silu(len(input_ids), h.dtype)
        for i, layer in enumerate(self.layers):
            if i and self.layer_hook is not None:
                self.layer_hook()
            qkv = layer.qkv(x)
            if layer.qkv_bias is not None:
                qkv += layer.qkv_bias
            if rows is None:
                attn = cpu_decode.decode_attention(qkv, self._cos, self._sin_signed, positions,
                                                   kv_cache, i, slots, tables, lens, self.scale,
                                                   s.num_heads)
            else:
                attn = cpu_verify.verify_attention(qkv, self._cos, self._sin_signed, positions,
                                                   kv_cache, i, slots, tables, lens, rows,
                                                   self.scale, s.num_heads)
            x = cpu_decode.add_rms_norm(h, layer.o(attn), layer.post_norm, self.eps)
            act = layer.gate_up.silu_mul(x) if fuse_mlp else None
            if act is None:
                gate_up = layer.gate_up(x)
                if self._silu:
                    act = cpu_decode.silu_mul(gate_up)
                else:
                    gate, up = gate_up.chunk(2, dim=1)
                    act = self.act(gate) * up
            nxt = self.layers[i + 1].input_norm if i + 1 < len(self.layers) else self.norm
            x = cpu_decode.add_rms_norm(h, layer.down(act), nxt, self.eps)
        return x

    def _attention(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata) -> torch.Tensor:
        kernels.write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        td = meta.num_decode_tokens
        parts = []
        if td:
            parts.append(kernels.paged_decode_attention(
                q[:td], k_cache, v_cache, meta.decode_block_tables, meta.decode_context_lens,
                self.scale, meta.decode_query_start_loc, meta.decode_max_query_len))
        if td < q.shape[0]:
            parts.append(kernels.prefill_attention(
                q[td:], k_cache, v_cache, meta.prefill_block_tables,
                meta.prefill_query_start_loc, meta.prefill_seq_lens, self.scale))
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def _attend_cpu(self, plan: PagedAttentionPlan, kv_rows: torch.Tensor, layer: int,
                    q: torch.Tensor, rows: int = 0) -> torch.Tensor:
        """q [T, Hq, D] over the cache (this step's K/V already written) → [T, Hq, D] (a
        prompt-only step's output inside a buffer of `rows` rows, `kernels.cpu_decode.rows_out`)."""
        td = plan.num_decode_tokens
        if td == q.shape[0]:
            return plan.decode_attention(kv_rows, layer, q, self.scale)
        if td == 0:
            return plan.prefill_attention(kv_rows, layer, q, self.scale, rows)
        return torch.cat([plan.decode_attention(kv_rows, layer, q[:td], self.scale),
                          plan.prefill_attention(kv_rows, layer, q[td:], self.scale)])

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden] → logits [N, vocab] float32."""
        return self.lm_head(hidden).float()

    def linears(self) -> list[Linear]:
        """Every weight matrix a decode step reads: the layers' four, then lm_head."""
        return [lin for layer in self.layers for lin in layer.linears()] + [self.lm_head]


def read_architecture(folder: Path) -> str:
    """The first `architectures` entry of folder/config.json."""
    return (json.loads((folder / "config.json").read_text()).get("architectures") or ["?"])[0]
