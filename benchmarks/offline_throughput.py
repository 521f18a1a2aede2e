"""Offline throughput: Baton vs the best transformers paths, same prompts, one run.

    .venv/bin/python benchmarks/offline_throughput.py                 # issue defaults
    .venv/bin/python benchmarks/offline_throughput.py --num-prompts 16 --prompt-len 256 \
        --output-len 64 --dtypes float32

For each dtype it runs the same random-token prompts (greedy, fixed output length) through
  * Baton's offline engine (`baton.LLM`: continuous batching over the paged KV cache),
  * transformers' padded batched `generate` (left padding, `min_new_tokens` = output length),
  * transformers' continuous-batching `generate_batch` where it runs on this machine,
and prints output tokens/s for each and Baton's ratio to the best transformers path.
Then Baton's batch-1 decode step time beside the floor: bytes of weights read per step
(every layer matrix + lm_head) divided by this machine's memory bandwidth measured now
(one read pass over a 512 MiB tensor, and a 256 MiB copy counting read + write).
"""
from __future__ import annotations

import argparse
import os
import random
import statistics
import time

import torch


def measure_bandwidth() -> tuple[float, float]:
    """(read GB/s of x.sum() over 512 MiB, copy GB/s counting read + write over 256 MiB)."""
    x = torch.ones(128 << 20, dtype=torch.float32)
    x.sum()
    t = time.perf_counter()
    for _ in range(5):
        x.sum()
    read = 5 * x.numel() * 4 / (time.perf_counter() - t) / 1e9
    a = torch.ones(64 << 20, dtype=torch.float32)
    b = torch.empty_like(a)
    b.copy_(a)
    t = time.perf_counter()
    for _ in range(5):
        b.copy_(a)
    copy = 5 * 2 * a.numel() * 4 / (time.perf_counter() - t) / 1e9
    return read, copy


def make_prompts(vocab: int, n: int, length: int, seed: int = 0,
                 shared_prefix: int = 0) -> list[list[int]]:
    """n random-token prompts of length ± 1/8; the first `shared_prefix` tokens are the same
    in every prompt (an agent's system prompt and tool list), the rest differ."""
    rng = random.Random(seed)
    prefix = [rng.randrange(10, vocab) for _ in range(shared_prefix)]
    return [prefix + [rng.randrange(10, vocab)
                      for _ in range(length - shared_prefix
                                     + rng.randrange(-length // 8, length // 8 + 1))]
            for _ in range(n)]


def vocab_of(llm) -> int:
    return llm.engine.model.shape.vocab_size


def run_baton(model: str, dtype: str, prompts, output_len: int) -> float:
    from baton import LLM, SamplingParams

    llm = LLM(model, dtype=dtype, max_num_seqs=len(prompts), max_num_batched_tokens=2048,
              long_prefill_token_threshold=512)
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    # warm-up on other tokens: warming on the measured prompts would leave them prefix-cached
    warm = [[(t * 7919 + 13) % vocab_of(llm) for t in p[:64]] for p in prompts[:2]]
    llm.generate(warm, SamplingParams(temperature=0.0, max_tokens=4))
    t = time.perf_counter()
    outs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - t
    assert all(len(o.output_token_ids) == output_len for o in outs)
    return sum(len(o.output_token_ids) for o in outs) / elapsed


def run_hf_padded(folder, dtype, prompts, output_len: int, batch_size: int) -> float:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).eval()
    pad = model.config.pad_token_id if model.config.pad_token_id is not None else 0
    with torch.no_grad():  # warm-up, as Baton gets
        model.generate(input_ids=torch.tensor([prompts[0][:64]]), max_new_tokens=4,
                       do_sample=False, pad_token_id=pad)
    total, t = 0, time.perf_counter()
    with torch.no_grad():
        for i in range(0, len(prompts), batch_size):
            batch = prompts[i:i + batch_size]
            width = max(map(len, batch))
            ids = torch.tensor([[pad] * (width - len(p)) + p for p in batch])
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
            out = model.generate(input_ids=ids, attention_mask=mask, do_sample=False,
                                 max_new_tokens=output_len, min_new_tokens=output_len,
                                 pad_token_id=pad)
            total += (out.shape[1] - width) * len(batch)
    return total / (time.perf_counter() - t)


def run_hf_continuous(folder, dtype, prompts, output_len: int) -> float:
    from transformers import AutoModelForCausalLM, GenerationConfig

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).eval()
    cfg = GenerationConfig(max_new_tokens=output_len, min_new_tokens=output_len,
                           do_sample=False, eos_token_id=-1, pad_token_id=0)
    t = time.perf_counter()
    with torch.no_grad():
        outs = model.generate_batch(prompts, generation_config=cfg, warmup=False)
    elapsed = time.perf_counter() - t
    return sum(len(o.generated_tokens) for o in outs.values()) / elapsed


def gemm_gflops(dtype: torch.dtype, m: int = 2048, k: int = 576, n: int = 3072) -> float:
    """This machine's sgemm rate now (GFLOP/s) on a prefill-shaped [m, k] @ [k, n] product."""
    x, w = torch.randn(m, k, dtype=dtype), torch.randn(k, n, dtype=dtype)
    x @ w
    t = time.perf_counter()
    for _ in range(3):
        x @ w
    return 3 * 2 * m * k * n / (time.perf_counter() - t) / 1e9


def prefill_floor_s(model: str, prompts, dtype: torch.dtype) -> float:
    """Seconds any engine needs for these prompts' prefill matmuls at the measured GEMM rate:
    2 FLOPs per weight per prompt token (layers only; lm_head runs on the last token), a lower
    bound that Baton and transformers share (both run the same MKL sgemm)."""
    from baton.models.registry import resolve_model
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(resolve_model(model))
    d = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    kv = cfg.num_key_value_heads or cfg.num_attention_heads
    per_layer = cfg.hidden_size * ((cfg.num_attention_heads + 2 * kv) * d) \
        + cfg.num_attention_heads * d * cfg.hidden_size + 3 * cfg.hidden_size * cfg.intermediate_size
    flops = 2 * per_layer * cfg.num_hidden_layers * sum(map(len, prompts))
    return flops / (gemm_gflops(dtype) * 1e9)


def batch1_matmul_ms(llm) -> float:
    """Median time of one batch-1 step's matmuls alone (every layer's GEMVs + lm_head, in the
    model's own layout and calls): the weight-streaming part of a decode step."""
    m = llm.engine.model
    xs = {n: torch.randn(1, n, dtype=m.dtype) for n in {lin.in_features for lin in m.linears()}}
    times = []
    for _ in range(10):
        t = time.perf_counter()
        for lin in m.linears():
            lin(xs[lin.in_features])
        times.append(time.perf_counter() - t)
    return 1000 * statistics.median(times)


def batch1_step_ms(model: str, dtype: str, context: int) -> tuple[float, int, float]:
    """Median Baton decode step (one sequence) in ms, weight bytes read per step, and the
    median time of the step's matmuls alone (ms)."""
    from baton import LLM, SamplingParams

    llm = LLM(model, dtype=dtype, kv_cache_memory_bytes=256 << 20)
    e = llm.engine
    e.add_request("b1", list(range(100, 100 + context)),
                  SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True))
    while e.get_request("b1").num_computed_tokens < context:
        e.step()
    times = []
    while e.has_unfinished_requests():
        t = time.perf_counter()
        e.step()
        times.append(time.perf_counter() - t)
    return (1000 * statistics.median(times[2:]), sum(lin.nbytes for lin in e.model.linears()),
            batch1_matmul_ms(llm))


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--hf-batch-size", type=int, default=16,
                   help="padded generate batch size (memory-bound on 24 GiB)")
    p.add_argument("--skip-hf-continuous", action="store_true")
    p.add_argument("--shared-prefix", type=int, default=0,
                   help="tokens every prompt shares at its start (agent system prompt); 0 = "
                        "fully distinct prompts")
    p.add_argument("--threads", type=int, default=os.cpu_count())
    return p


def _compare_dtype(args, folder, prompts, dtype_name: str) -> None:
    """Baton vs transformers output tokens/s at one dtype, and the prefill floor's cap."""
    dtype = getattr(torch, dtype_name)
    print(f"\n[{dtype_name}] output tokens/s", flush=True)
    runs = {"baton": lambda: run_baton(args.model, dtype_name, prompts, args.output_len),
            "transformers padded generate": lambda: run_hf_padded(
                folder, dtype, prompts, args.output_len, args.hf_batch_size)}
    if not args.skip_hf_continuous:
        runs["transformers generate_batch"] = lambda: run_hf_continuous(
            folder, dtype, prompts, args.output_len)
    rows = {}
    for name, run in runs.items():
        try:
            rows[name] = run()
        except Exception as exc:  # noqa: BLE001 - report and carry on
            print(f"  {name:32s} failed here: {exc!r:.200}", flush=True)
            continue
        print(f"  {name:32s} {rows[name]:9.1f}", flush=True)
    best = max((v for k, v in rows.items() if k != "baton"), default=None)
    if best:
        print(f"  baton / best transformers      {rows['baton'] / best:9.2f}x  (target ≥ 3x)")
        floor = prefill_floor_s(args.model, prompts, dtype)
        ceiling = args.num_prompts * args.output_len / floor / best
        if not args.shared_prefix:  # with a shared prefix Baton skips part of the prefill
            print(f"  prefill matmul floor {floor:.1f} s at this machine's GEMM rate → even "
                  f"a decode that cost nothing caps the ratio at {ceiling:.2f}x")


def _batch1_vs_floor(model: str, context: int) -> None:
    """The batch-1 fp32 decode step beside the weight-read floor measured in this run."""
    read_bw, copy_bw = measure_bandwidth()
    step_ms, weight_bytes, matmul_ms = batch1_step_ms(model, "float32", context)
    floor_read = weight_bytes / (read_bw * 1e9) * 1e3
    floor_copy = weight_bytes / (copy_bw * 1e9) * 1e3
    print(f"\nbatch-1 decode step (fp32, context {context}): {step_ms:.1f} ms")
    print(f"  of which the step's matmuls alone take {matmul_ms:.1f} ms")
    print(f"  weights read per step {weight_bytes / 1e6:.0f} MB; read bw {read_bw:.1f} GB/s, "
          f"copy bw (r+w) {copy_bw:.1f} GB/s")
    print(f"  floor by read bw {floor_read:.1f} ms → ratio {step_ms / floor_read:.2f}x; "
          f"floor by copy bw {floor_copy:.1f} ms → ratio {step_ms / floor_copy:.2f}x "
          f"(target ≤ 1.5x)")


def main() -> None:
    p = _parser()
    args = p.parse_args()
    torch.set_num_threads(args.threads)

    from baton.models.registry import resolve_model
    from transformers import AutoConfig

    folder = resolve_model(args.model)
    vocab = AutoConfig.from_pretrained(folder).vocab_size
    if not 0 <= args.shared_prefix < args.prompt_len * 7 // 8:
        p.error("--shared-prefix must be below 7/8 of --prompt-len")
    prompts = make_prompts(vocab, args.num_prompts, args.prompt_len,
                           shared_prefix=args.shared_prefix)
    print(f"{args.num_prompts} prompts of ~{args.prompt_len} tokens, {args.output_len} output "
          f"tokens each, {args.threads} threads, model {args.model}")
    for dtype_name in args.dtypes.split(","):
        _compare_dtype(args, folder, prompts, dtype_name)
    _batch1_vs_floor(args.model, args.prompt_len)


if __name__ == "__main__":
    main()
