"""gpu_check section `bf16`: the engine in bfloat16 on the device against transformers in
bfloat16 on the same device and weights, by vLLM's `check_logprobs_close` rule
(baton/closeness.py): per prompt the greedy tokens agree up to the first divergence, where
each side's token is in the other's top-5, and the check stops there.

    24 prompts of 1 to 200 tokens (dry-run: 6 of 1 to 24), 12 greedy tokens each, on both
    model shapes of gpu_check_engine (random weights, the saved folders of the `engine`
    section); at least half the prompts must agree on every token (else the rule would be
    checking nothing). The engines stay in ctx.engines_bf16 for `decode_floor`.

bf16 is the production dtype on GPUs (`--dtype auto` on CUDA); it cannot be token-exact
against another implementation's bf16 (other kernels round in other orders).
"""
from __future__ import annotations

import random

import torch

from gpu_check import FAIL, PASS, log
from gpu_check_engine import SHAPES, make_engine, model_folder

TOP, NEW_TOKENS = 5, 12


def prompts_for(vocab: int, count: int, longest: int, seed: int = 0) -> list[list[int]]:
    """`count` random prompts: lengths 1, 2, 15, 16, 17, 33 and `longest`, then random."""
    rng = random.Random(seed)
    fixed = [n for n in (1, 2, 15, 16, 17, 33, longest) if n <= longest]
    lengths = fixed + [rng.randrange(3, longest) for _ in range(count - len(fixed))]
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths[:count]]


def _cache_kwargs(out) -> dict:
    """The previous output's KV cache as the next call's keyword: transformers ≥ 5.2x names
    it `cache`, earlier 5.x (the GPU image's 5.17) `past_key_values`."""
    if hasattr(out, "cache"):
        return {"cache": out.cache}
    return {"past_key_values": out.past_key_values}


@torch.no_grad()
def hf_bf16_runs(folder, device, prompts: list[list[int]]) -> list[tuple[list[int], list[set]]]:
    """transformers in bf16 on `device`, greedy with its own KV cache: per prompt (tokens,
    top-5 ids at each position)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).to(device).eval()
    runs = []
    for prompt in prompts:
        out = model(torch.tensor([prompt], device=device), use_cache=True)
        tokens, tops = [], []
        for _ in range(NEW_TOKENS):
            logits = out.logits[0, -1].float()
            tokens.append(int(logits.argmax()))
            tops.append(set(logits.topk(TOP).indices.tolist()))
            out = model(torch.tensor([[tokens[-1]]], device=device), use_cache=True,
                        **_cache_kwargs(out))
        runs.append((tokens, tops))
    del model
    return runs


def baton_runs(engine, prompts: list[list[int]]) -> list[tuple[list[int], list[set]]]:
    """The engine's greedy tokens and top-5 ids per position, all prompts in one batch."""
    from baton.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True,
                            logprobs=TOP)
    ids = [f"bf16-{i}" for i in range(len(prompts))]
    for rid, prompt in zip(ids, prompts):
        engine.add_request(rid, prompt, params)
    runs = {rid: ([], []) for rid in ids}
    while engine.has_unfinished_requests():
        for out in engine.step():
            runs[out.request_id][0].extend(out.new_token_ids)
            runs[out.request_id][1].extend(set(lp.top) for lp in out.logprobs)
    return [runs[rid] for rid in ids]


def _check(ctx, name: str) -> tuple[bool, str]:
    from baton.closeness import check_logprobs_close

    folder = model_folder(ctx, name)
    engine = make_engine(ctx, folder, num_blocks=256 if ctx.dry_run else 2048, dtype="bfloat16",
                         max_num_seqs=32)
    assert engine.kv_cache.dtype == torch.bfloat16
    count, longest = (6, 24) if ctx.dry_run else (24, 200)
    prompts = prompts_for(engine.vocab_size, count, longest)
    ours = baton_runs(engine, prompts)
    theirs = hf_bf16_runs(folder, ctx.device, prompts)
    try:
        exact = check_logprobs_close(ours, theirs, "baton", "transformers", TOP)
    except AssertionError as e:
        return False, f"{name}: {e}"
    ctx.engines_bf16[name] = engine
    ctx.report.setdefault("bf16", {})[name] = {"prompts": len(prompts), "all_tokens_equal": exact}
    msg = f"{name}: {exact} of {len(prompts)} prompts x {NEW_TOKENS} tokens equal, the rest close"
    log(msg)
    if exact < len(prompts) // 2:
        return False, f"{msg} (fewer than half: the rule checked little)"
    return True, msg


def section_bf16(ctx) -> tuple[str, str]:
    ctx.engines_bf16 = getattr(ctx, "engines_bf16", {})
    results = {name: _check(ctx, name) for name in SHAPES}
    bad = [r for ok, r in results.values() if not ok]
    if bad:
        return FAIL, bad[0]
    return PASS, (f"bf16 vs transformers bf16 on {ctx.device} by vLLM's check_logprobs_close: "
                  + "; ".join(r for _, r in results.values()))
