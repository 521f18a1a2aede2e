"""bf16 prefill attention over a cached prefix, on the CPU paths, computes its softmax in fp32.

Both CPU entry points, `kernels.prefill_attention_ref` (prefill_attention's CPU path) and
`PagedAttentionPlan.prefill_attention` (the engine's), call torch's SDPA on bf16 tensors with a
bottom-right causal mask. torch sends those to its CPU flash-attention kernel, whose accumulator
type for bf16 is float: running max, exponentials, row sums and the P·V accumulator are fp32
(P is rounded to bf16 as the P·V GEMM's input) and the output is rounded once; its math
fallback upcasts bf16 to fp32 unless `allow_fp16_bf16_reduction_math_sdp` is set. Checked
here two ways: the backend torch picks, and the error over a 2,048-token prefix of nearly
uniform scores against an fp64 oracle on the same bf16 inputs. A softmax summed in bf16 would
fail the second by a factor: its row sum stalls near 256, where bf16's spacing (2) exceeds each
term (<= 1), while the fp32 one reaches ~2,048.
"""
import torch

from kernels import prefill_attention_ref
from kernels.paged_cpu import PagedAttentionPlan
from tests.kernels.test_prefill_attention import _case, _oracle

PREFIX, Q_LEN = 2048, 4
SHAPE = (1, 3, 64, 16, 0)  # SmolLM2's GQA 3:1, head size 64, 16-token blocks


def _long_case():
    args = list(_case(*SHAPE, torch.bfloat16, seqs=[(PREFIX + Q_LEN, Q_LEN)]))
    args[0] = (args[0].float() * 0.05).bfloat16()  # small q: nearly uniform softmax
    return tuple(args)


def test_torch_picks_an_fp32_softmax_backend_for_bf16():
    q = torch.zeros(1, 3, Q_LEN, 64, dtype=torch.bfloat16)
    kv = torch.zeros(1, 1, PREFIX + Q_LEN, 64, dtype=torch.bfloat16)
    mask = torch.ones(Q_LEN, PREFIX + Q_LEN, dtype=torch.bool)
    for m, causal in ((mask, False), (None, True)):
        backend = torch._fused_sdp_choice(q, kv, kv, m, 0.0, causal, enable_gqa=True)
        flash, math = 1, 0  # torch.nn.attention.SDPBackend.FLASH_ATTENTION, .MATH
        assert backend == flash or (backend == math
                                    and not torch._C._get_math_sdp_allow_fp16_bf16_reduction())


def test_long_prefix_error_is_that_of_an_fp32_softmax():
    query, key_cache, value_cache, tables, starts, seq_lens, scale = _long_case()
    want = _oracle(query, key_cache, value_cache, tables, starts, seq_lens, scale)
    bound = 2.0**-7 * want.abs().max().item()  # about one bf16 rounding of the output
    got = prefill_attention_ref(query, key_cache, value_cache, tables, starts, seq_lens, scale)
    assert (got.double() - want).abs().max().item() <= bound
    # the engine's path: the same prefix read through a plan over a one-layer cache
    kv = torch.stack([key_cache, value_cache], 1)[:, None]  # [NB, 1, 2, BS, Hkv, D]
    plan = PagedAttentionPlan(tuple(kv.shape), torch.full((Q_LEN,), -1, dtype=torch.int64), 0,
                              prefill_block_tables=tables, prefill_query_start_loc=starts,
                              prefill_seq_lens=seq_lens)
    got = plan.prefill_attention(kv.view(-1, *kv.shape[-2:]), 0, query, scale)
    assert (got.double() - want).abs().max().item() <= bound
