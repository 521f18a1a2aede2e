"""Model resolution errors name what was expected, before anything loads."""
import json
import shutil

import pytest
import torch

from baton import LLM, SamplingParams
from baton.models.registry import ModelNotFoundError, UnsupportedModelError, resolve_model


def test_unknown_name_lists_registered_models():
    with pytest.raises(ModelNotFoundError, match="smollm2-135m"):
        resolve_model("no-such-model")


def test_folder_without_weights(tmp_path, tiny_llama):
    shutil.copy(tiny_llama / "config.json", tmp_path / "config.json")
    with pytest.raises(ModelNotFoundError, match="safetensors"):
        resolve_model(str(tmp_path))


def test_unsupported_architecture(tmp_path, tiny_llama):
    for f in tiny_llama.iterdir():
        shutil.copy(f, tmp_path / f.name)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedModelError, match="LlamaForCausalLM"):
        resolve_model(str(tmp_path))


def test_bad_arguments_and_prompts_are_clear_errors(tiny_llama):
    with pytest.raises(TypeError, match="bogus"):
        LLM(str(tiny_llama), bogus=1, dtype="float32")
    with pytest.raises(ValueError, match="block_size"):
        LLM(str(tiny_llama), block_size=3, dtype="float32")
    llm = LLM(str(tiny_llama), num_blocks=16, max_model_len=64, dtype="float32")
    with pytest.raises(ValueError, match="empty"):
        llm.generate([[]])
    with pytest.raises(ValueError, match="context limit"):
        llm.generate([[5] * 60], SamplingParams(max_tokens=10))
    with pytest.raises(ValueError, match=r"\[0, "):
        llm.generate([[10**6]])
    # Nothing was left queued or holding blocks; the engine still serves.
    assert llm.engine.num_unfinished_requests == 0 and llm.engine.kv.num_free_blocks == 16
    assert llm.generate([[5, 6]], SamplingParams(max_tokens=2))[0].finish_reason == "length"


def test_bfloat16_engine_runs(tiny_qwen3):
    llm = LLM(str(tiny_qwen3), dtype="bfloat16", num_blocks=16)
    out = llm.generate([[5, 6, 7, 8]], SamplingParams(temperature=0, max_tokens=4,
                                                      ignore_eos=True))[0]
    assert len(out.output_token_ids) == 4
    assert llm.engine.runner.kv_cache.dtype == torch.bfloat16
    assert llm.engine.model.layers[0].qkv.dtype == torch.bfloat16


def test_sampling_outputs_logprobs_stop_and_n(tiny_llama):
    llm = LLM(str(tiny_llama), num_blocks=32, dtype="float32")
    params = SamplingParams(temperature=0.8, seed=7, max_tokens=5, n=2, logprobs=3,
                            ignore_eos=True)
    (out,) = llm.generate([[5, 6, 7]], params)
    assert len(out.outputs) == 2 and [c.index for c in out.outputs] == [0, 1]
    for c in out.outputs:
        assert len(c.logprobs) == len(c.token_ids) == 5
        assert all(len(lp.top) == 3 and lp.logprob <= 0 for lp in c.logprobs)
        for lp in c.logprobs:  # rank: 1 + tokens above the sampled one (top-3 tells ranks 1-3)
            above = sum(v > lp.logprob for v in lp.top.values())
            assert lp.rank >= 1 and (lp.rank == above + 1 if lp.rank <= 3 else above == 3)
    again = llm.generate([[5, 6, 7]], params)[0]
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in out.outputs]
    # A stop string cuts the text; finish_reason says stop and stop_reason names it.
    text = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=12,
                                                    ignore_eos=True))[0].text
    stop = text[3:5]
    cut = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=12,
                                                   ignore_eos=True, stop=[stop]))[0]
    assert cut.finish_reason == "stop" and cut.outputs[0].stop_reason == stop
    assert cut.text == text[:text.index(stop)]
