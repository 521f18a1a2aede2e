"""gpu_check section `engine`: LLMEngine on a device against transformers in fp32, and the
models, engines and runners the other engine sections share (gpu_check_bf16, _disagg, _graphs).

Models are random-weight Llama configs of real models' shapes, built in-process (nothing
from a hub) and saved as a Hugging Face folder the engine loads like any other:

    smollm2-135m   hidden 576, 30 layers, 9 heads / 3 KV heads, MLP 1536, vocab 49152, tied
    llama-3.2-1b   hidden 2048, 16 layers, 32 heads / 8 KV heads, MLP 8192, vocab 128256,
                   tied, llama3 rope scaling (factor 32)

The dry-run uses tiny models of the same structure (GQA ratio, tying, rope type) and runs
the engine's CUDA attention path on CPU: `DecoderModel._attention` with the Triton launchers
under the interpreter (`triton_launchers_on_cpu`), instead of kernels/paged_cpu.py. On CUDA
the engine replays its decode steps as CUDA graphs (its default), so the fp32 check covers
them too. The
tokenizer is a word-level one with exactly the model's vocabulary (`<t0>` ... `<tV-1>`), so
every sampled id detokenizes. Weights are drawn with initializer_range 0.08 (as
tests/tiny_models.py) so greedy argmax is rarely a near-tie and token-exact comparison
against transformers means something.
"""
from __future__ import annotations

import contextlib
import itertools
import random
import time

import torch

from gpu_check import FAIL, PASS, log

SHAPES = {
    "smollm2-135m": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, vocab_size=49152,
                         max_position_embeddings=8192, rope_theta=100000.0),
    "llama-3.2-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                         num_attention_heads=32, num_key_value_heads=8, head_dim=64,
                         vocab_size=128256, max_position_embeddings=131072,
                         rope_theta=500000.0, rope_scaling=dict(
                             rope_type="llama3", factor=32.0, low_freq_factor=1.0,
                             high_freq_factor=4.0, original_max_position_embeddings=8192)),
}
TINY = {
    "smollm2-135m": dict(hidden_size=96, intermediate_size=192, num_hidden_layers=2,
                         num_attention_heads=3, num_key_value_heads=1, vocab_size=512,
                         max_position_embeddings=1024, rope_theta=100000.0),
    "llama-3.2-1b": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=8, num_key_value_heads=2, head_dim=16,
                         vocab_size=640, max_position_embeddings=1024, rope_theta=500000.0,
                         rope_scaling=dict(rope_type="llama3", factor=32.0,
                                           low_freq_factor=1.0, high_freq_factor=4.0,
                                           original_max_position_embeddings=256)),
}
BLOCK_SIZE = 16
NEAR_TIE = 1e-4  # relative top-1 − top-2 gap under which a differing greedy token is a tie
_request_ids = itertools.count()


@contextlib.contextmanager
def triton_launchers_on_cpu(calls: list[str], model):
    """Dry-run only: `model`'s forward on CPU takes the path a CUDA kv_cache takes (the
    kernels' dispatchers: `DecoderModel.cpu_attention` off), and its kernel calls go to the
    `*_triton` launchers (interpreted). Appends each launcher's name to `calls` when it
    runs, so a decoder change that bypasses the patch shows as no calls."""
    import kernels

    names = ("write_kv", "paged_decode_attention", "prefill_attention")
    saved = model.cpu_attention, [getattr(kernels, n) for n in names]

    def counted(name):
        launcher = getattr(kernels, f"{name}_triton")

        def run(*args, **kwargs):
            calls.append(name)
            return launcher(*args, **kwargs)
        return run

    model.cpu_attention = False
    for n in names:
        setattr(kernels, n, counted(n))
    try:
        yield
    finally:
        model.cpu_attention = saved[0]
        for n, f in zip(names, saved[1]):
            setattr(kernels, n, f)


def _tokenizer(vocab_size: int):
    """A word-level PreTrainedTokenizerFast whose ids are exactly [0, vocab_size)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"<t{i}>": i for i in range(vocab_size)}, unk_token="<t0>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<t0>", bos_token="<t1>",
                                   eos_token="<t2>", pad_token="<t0>")


def build_model(ctx, name: str):
    """(folder, transformers model on ctx.device) for the shape `name`; the folder is kept in
    ctx.models for later sections (`model_folder`)."""
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()

    shape = (TINY if ctx.dry_run else SHAPES)[name]
    cfg = LlamaConfig(**shape, rms_norm_eps=1e-5, initializer_range=0.08, tie_word_embeddings=True,
                      bos_token_id=1, eos_token_id=2, pad_token_id=0,
                      architectures=["LlamaForCausalLM"])
    folder = ctx.workdir / name
    torch.manual_seed(0)
    with torch.device(ctx.device):
        model = LlamaForCausalLM(cfg).eval()
    model.save_pretrained(folder)
    _tokenizer(shape["vocab_size"]).save_pretrained(folder)
    ctx.models[name] = folder
    return folder, model


def model_folder(ctx, name: str):
    """The saved folder of the shape `name` (built now when the engine section did not)."""
    if name not in ctx.models:
        folder, model = build_model(ctx, name)
        del model
    return ctx.models[name]


def engine_config(ctx, folder, num_blocks: int, dtype: str = "float32",
                  max_num_seqs: int = 8, **engine):
    """The check's EngineConfig on ctx.device (CUDA graphs for decode steps of up to
    max_num_seqs rows unless enforce_eager=True is passed); `engine` holds EngineConfig or
    CacheConfig fields (e.g. kv_host_tier_bytes)."""
    from baton.config import CacheConfig, EngineConfig, SchedulerConfig

    cache = {k: engine.pop(k) for k in list(engine) if k in CacheConfig.__dataclass_fields__}
    return EngineConfig(
        model=str(folder), dtype=dtype, device=str(ctx.device),
        cache=CacheConfig(block_size=BLOCK_SIZE, num_blocks=num_blocks, **cache),
        scheduler=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=2048),
        **engine)


def make_engine(ctx, folder, num_blocks: int, dtype: str = "float32", max_num_seqs: int = 8,
                **engine):
    from baton.engine.llm_engine import LLMEngine

    return LLMEngine(engine_config(ctx, folder, num_blocks, dtype, max_num_seqs, **engine))


def run_engine(engine, prompts, max_tokens: int) -> tuple[list[list[int]], float, float]:
    """Greedy outputs of `prompts` run together; (outputs, seconds in all, seconds after the
    first step, i.e. decode)."""
    from baton.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    ids = [f"r{next(_request_ids)}" for _ in prompts]
    for rid, p in zip(ids, prompts):
        engine.add_request(rid, p, params)
    outs = {rid: [] for rid in ids}
    t0 = time.perf_counter()
    t_first = None
    while engine.has_unfinished_requests():
        for o in engine.step():
            outs[o.request_id].extend(o.new_token_ids)
        t_first = t_first or time.perf_counter()
    t1 = time.perf_counter()
    return [outs[r] for r in ids], t1 - t0, t1 - (t_first or t1)


@torch.no_grad()
def hf_greedy(model, prompt: list[int], max_tokens: int) -> tuple[list[int], list[float]]:
    """transformers' greedy tokens (full recompute each step) and each step's top-1 − top-2
    logit gap relative to max(1, |top-1 logit|)."""
    ids = torch.tensor([prompt], device=model.device)
    out, gaps = [], []
    for _ in range(max_tokens):
        logits = model(ids).logits[0, -1].float()
        top = logits.topk(2).values
        token = int(logits.argmax())
        out.append(token)
        gaps.append(float((top[0] - top[1]) / top[0].abs().clamp_min(1.0)))
        ids = torch.cat([ids, torch.tensor([[token]], device=ids.device)], dim=1)
    return out, gaps


def _check_model(ctx, name: str, calls: list[str]) -> tuple[bool, str]:
    """Greedy tokens vs transformers (in the dry-run through `triton_launchers_on_cpu`),
    then tokens/s at batch 1 and 8; keeps the engine in ctx.engines for `graphs`."""
    folder, hf = build_model(ctx, name)
    vocab = hf.config.vocab_size
    engine = make_engine(ctx, folder, num_blocks=256 if ctx.dry_run else 2048)
    rng = random.Random(0)
    lengths = [1, 17, 33] if ctx.dry_run else [1, 17, 33, 64, 200]
    max_tokens = 5 if ctx.dry_run else 16
    prompts = [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]
    with triton_launchers_on_cpu(calls, engine.model) if ctx.dry_run \
            else contextlib.nullcontext():
        got, _, _ = run_engine(engine, prompts, max_tokens)
    ok, notes = True, []
    for prompt, tokens in zip(prompts, got):
        want, gaps = hf_greedy(hf, prompt, max_tokens)
        if tokens != want:
            i = next(j for j, (a, b) in enumerate(zip(tokens, want)) if a != b)
            tie = gaps[i] < NEAR_TIE  # two fp32 summation orders may pick either
            ok = ok and tie
            notes.append(f"prompt {len(prompt)}: differs at token {i} (reference top-2 gap "
                         f"{gaps[i]:.1e} of the top logit{', a near-tie' if tie else ''})")
    log(f"{name}: {len(prompts)} prompts x {max_tokens} greedy tokens vs transformers on "
        f"{ctx.device}: {'equal' if not notes else '; '.join(notes)}")
    del hf
    rates = {}
    plen, new = (8, 4) if ctx.dry_run else (32, 64)
    run_engine(engine, [[3 + i] * plen for i in range(8)], 2)  # warm-up at batch 8
    for batch in (1, 8):
        prompts = [[rng.randrange(3, vocab) for _ in range(plen)] for _ in range(batch)]
        outs, total_s, decode_s = run_engine(engine, prompts, new)
        n = sum(len(o) for o in outs)
        rates[batch] = {"tok_s": n / total_s, "decode_tok_s": (n - batch) / max(decode_s, 1e-9)}
        log(f"{name}: batch {batch}: {n} tokens in {total_s:.2f} s = {n / total_s:.1f} tok/s "
            f"(decode steps only {rates[batch]['decode_tok_s']:.1f} tok/s)")
    ctx.report.setdefault("engine", {})[name] = {"match": ok, "notes": notes, "rates": rates}
    ctx.engines[name] = engine
    return ok, notes[0] if notes else "equal"


def section_engine(ctx) -> tuple[str, str]:
    results, calls = {}, []
    for name in SHAPES:
        results[name] = _check_model(ctx, name, calls)
        if ctx.device.type == "cuda":
            torch.cuda.empty_cache()
    bad = [n for n, (ok, _) in results.items() if not ok]
    if bad:
        return FAIL, f"greedy tokens differ from transformers for {bad}: {results[bad[0]][1]}"
    if ctx.dry_run:
        missing = {"write_kv", "paged_decode_attention", "prefill_attention"} - set(calls)
        if missing:
            return FAIL, f"the dry-run's CUDA-path emulation never ran {sorted(missing)}"
        return PASS, (f"{', '.join(results)}: fp32 greedy == transformers, through the CUDA "
                      "attention path (Triton launchers, interpreted)")
    return PASS, (f"{', '.join(results)}: fp32 greedy == transformers on {ctx.device} "
                  "(decode steps replayed as CUDA graphs)")
