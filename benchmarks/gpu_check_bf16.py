"""gpu_check section `bf16`: the engine in bfloat16 on the device against transformers in
bfloat16 on the same device and weights, by vLLM's `check_logprobs_close` rule
(baton/closeness.py): per prompt the greedy tokens agree up to the first divergence, where
each side's token is in the other's top-5, and the check stops there.

    24 prompts of 1 to 200 tokens (dry-run: 6 of 1 to 24), 12 greedy tokens each, on both
    model shapes of gpu_check_engine (random weights, the saved folders of the `engine`
    section); at least half the prompts must agree on every token (else the rule would be
    checking nothing). The engines stay in ctx.engines_bf16 for `decode_floor`. Where the
    runs diverge, the fp32 model says whose token it prefers and what each side's token
    costs in fp32 logprob (`divergences`).

Random weights give flat next-token distributions (top logprob about -5 at 49K tokens on the
H200 run of 2026-12-04: dozens of tokens within bf16 noise of the top), where the top-5 rule
breaks by chance on either side and few prompts stay equal. Where it breaks, the section
still passes if baton's bf16 is at least as faithful to fp32 as transformers' bf16: fp32's
argmax is baton's token at least as often as transformers', and baton's mean fp32 regret is
at most REGRET_RATIO times transformers' (+ REGRET_SLACK). A broken bf16 path loses both.

bf16 is the production dtype on GPUs (`--dtype auto` on CUDA); it cannot be token-exact
against another implementation's bf16 (other kernels round in other orders).
"""
from __future__ import annotations

import random

import torch

from gpu_check import FAIL, PASS, log
from gpu_check_engine import SHAPES, make_engine, model_folder

TOP, NEW_TOKENS = 5, 12
# where the rule breaks: baton's mean fp32 regret at the divergences may exceed transformers'
# by this ratio plus slack (a handful of divergences, many with regret 0)
REGRET_RATIO, REGRET_SLACK = 1.25, 0.02


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
def hf_bf16_runs(folder, device, prompts: list[list[int]]) -> list[tuple[list[int], list[set],
                                                                       list[dict]]]:
    """transformers in bf16 on `device`, greedy with its own KV cache: per prompt (tokens,
    top-5 ids at each position, top-5 {id: logprob} at each position)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).to(device).eval()
    runs = []
    for prompt in prompts:
        out = model(torch.tensor([prompt], device=device), use_cache=True)
        tokens, tops, lps = [], [], []
        for _ in range(NEW_TOKENS):
            logprobs = out.logits[0, -1].float().log_softmax(-1)
            tokens.append(int(logprobs.argmax()))
            best = logprobs.topk(TOP)
            tops.append(set(best.indices.tolist()))
            lps.append(dict(zip(best.indices.tolist(), best.values.tolist())))
            out = model(torch.tensor([[tokens[-1]]], device=device), use_cache=True,
                        **_cache_kwargs(out))
        runs.append((tokens, tops, lps))
    del model
    return runs


def baton_runs(engine, prompts: list[list[int]]) -> list[tuple[list[int], list[set], list[dict]]]:
    """The engine's greedy tokens, top-5 ids and top-5 {id: logprob} per position, all prompts
    in one batch."""
    from baton.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True,
                            logprobs=TOP)
    ids = [f"bf16-{i}" for i in range(len(prompts))]
    for rid, prompt in zip(ids, prompts):
        engine.add_request(rid, prompt, params)
    runs = {rid: ([], [], []) for rid in ids}
    while engine.has_unfinished_requests():
        for out in engine.step():
            run = runs[out.request_id]
            run[0].extend(out.new_token_ids)
            run[1].extend(set(lp.top) for lp in out.logprobs)
            run[2].extend(dict(lp.top) for lp in out.logprobs)
    return [runs[rid] for rid in ids]


@torch.no_grad()
def divergences(folder, device, prompts, ours, theirs) -> dict:
    """Who the fp32 model agrees with where the two bf16 runs first diverge: per diverging
    prompt, the fp32 log-softmax at the common prefix (transformers in fp32, one forward),
    its argmax and the fp32 logprob of each side's token. A side whose bf16 is as accurate
    as the other's picks the fp32 argmax about as often and loses as little fp32 logprob
    ("regret" = lp32(argmax) - lp32(token)). Returns the summary (also logged)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).to(device).eval()
    rows = []
    for i, (prompt, a, b) in enumerate(zip(prompts, ours, theirs)):
        pos = next((p for p, (x, y) in enumerate(zip(a[0], b[0])) if x != y), None)
        if pos is None:
            continue
        prefix = list(prompt) + list(a[0][:pos])
        lp = model(torch.tensor([prefix], device=device)).logits[0, -1].float().log_softmax(-1)
        top = int(lp.argmax())
        x, y = a[0][pos], b[0][pos]
        rows.append({"prompt": i, "pos": pos, "baton": x, "transformers": y, "fp32_argmax": top,
                     "regret_baton": float(lp[top] - lp[x]),
                     "regret_transformers": float(lp[top] - lp[y]),
                     "baton_lp": a[2][pos], "transformers_lp": b[2][pos],
                     "fp32_lp": {t: float(lp[t]) for t in {x, y, top}}})
        r = rows[-1]
        log(f"  prompt {i} pos {pos}: baton {x} (fp32 regret {r['regret_baton']:.3f}), "
            f"transformers {y} (regret {r['regret_transformers']:.3f}), fp32 argmax {top}; "
            f"fp32 lp {r['fp32_lp']}")
    del model
    n = len(rows)
    summary = {"divergences": n, "rows": rows,
               "baton_is_fp32_argmax": sum(r["baton"] == r["fp32_argmax"] for r in rows),
               "transformers_is_fp32_argmax": sum(r["transformers"] == r["fp32_argmax"]
                                                  for r in rows),
               "mean_regret_baton": sum(r["regret_baton"] for r in rows) / max(n, 1),
               "mean_regret_transformers": sum(r["regret_transformers"] for r in rows)
               / max(n, 1)}
    log(f"  {n} divergences: fp32 argmax = baton's token {summary['baton_is_fp32_argmax']}x, "
        f"transformers' {summary['transformers_is_fp32_argmax']}x; mean fp32 regret baton "
        f"{summary['mean_regret_baton']:.3f}, transformers {summary['mean_regret_transformers']:.3f}")
    return summary


def faithful_to_fp32(d: dict) -> bool:
    """Is baton's bf16 at least as faithful to fp32 as transformers' at the divergences of
    `d` (a `divergences` summary)? fp32 picks baton's token at least as often, and baton's
    mean fp32 regret is at most REGRET_RATIO x transformers' + REGRET_SLACK."""
    return (d["baton_is_fp32_argmax"] >= d["transformers_is_fp32_argmax"]
            and d["mean_regret_baton"] <= REGRET_RATIO * d["mean_regret_transformers"]
            + REGRET_SLACK)


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
    ctx.engines_bf16[name] = engine  # decode_floor times it whatever the rule finds
    report = ctx.report.setdefault("bf16", {})
    d = divergences(folder, ctx.device, prompts, ours, theirs)
    faithful = faithful_to_fp32(d)
    fp32 = (f"at {d['divergences']} divergences fp32 prefers baton's token "
            f"{d['baton_is_fp32_argmax']}x, transformers' {d['transformers_is_fp32_argmax']}x, "
            f"mean fp32 regret {d['mean_regret_baton']:.3f} vs {d['mean_regret_transformers']:.3f}")
    try:
        exact = check_logprobs_close([r[:2] for r in ours], [r[:2] for r in theirs], "baton",
                                     "transformers", TOP)
        rule = None if exact >= len(prompts) // 2 else \
            f"{exact} of {len(prompts)} prompts equal (fewer than half: the rule checked little)"
    except AssertionError as e:
        exact, rule = None, str(e)
    report[name] = {"prompts": len(prompts), "all_tokens_equal": exact, "rule_broken": rule,
                    "as_faithful_to_fp32": faithful, "divergences": d}
    if rule is None:
        msg = f"{name}: {exact} of {len(prompts)} prompts x {NEW_TOKENS} tokens equal, " \
              f"the rest close"
    elif faithful:
        msg = f"{name}: rule not met ({rule}), but baton's bf16 is as faithful to fp32 as " \
              f"transformers' ({fp32})"
    else:
        return False, f"{name}: {rule}; {fp32}"
    log(msg)
    return True, msg


def section_bf16(ctx) -> tuple[str, str]:
    ctx.engines_bf16 = getattr(ctx, "engines_bf16", {})
    results = {name: _check(ctx, name) for name in SHAPES}
    bad = [r for ok, r in results.values() if not ok]
    if bad:
        return FAIL, bad[0]
    return PASS, (f"bf16 vs transformers bf16 on {ctx.device} by vLLM's check_logprobs_close: "
                  + "; ".join(r for _, r in results.values()))
