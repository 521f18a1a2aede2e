"""The engine's `device` option (CPU here; CUDA is checked by benchmarks/gpu_check.py) and an
engine without xgrammar (the GPU image has none)."""
from __future__ import annotations

import pytest
import torch

from baton import LLM, SamplingParams
from baton.config import EngineConfig
from baton.engine import grammar
from baton.sampling_params import StructuredOutput, StructuredOutputKind
from tests.reference import hf_greedy


@pytest.mark.parametrize("name", ["mps", "gpu", "cuda:x", ""])
def test_unknown_device_is_refused(name):
    with pytest.raises(ValueError, match="device must be"):
        EngineConfig(device=name)


@pytest.mark.parametrize("name, want", [("cpu", "cpu"), ("cuda", "cuda"), ("cuda:1", "cuda:1")])
def test_device_names_parse(name, want):
    assert EngineConfig(device=name).torch_device == torch.device(want)


def test_cpu_device_places_everything_on_cpu_and_matches_reference(tiny_llama):
    llm = LLM(str(tiny_llama), num_blocks=32, device="cpu", dtype="float32")
    runner = llm.engine.runner
    assert runner.kv_cache.device.type == "cpu" and llm.engine.model.embed.device.type == "cpu"
    prompt = [5, 9, 14, 3, 7]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    out = llm.generate([prompt], params)[0]
    assert out.outputs[0].token_ids == hf_greedy(tiny_llama, prompt, 6)


def test_structured_output_without_xgrammar_is_a_clear_value_error(monkeypatch):
    monkeypatch.setattr(grammar, "xgr", None)
    spec = StructuredOutput(StructuredOutputKind.JSON_OBJECT)
    with pytest.raises(ValueError, match="xgrammar"):
        grammar.build_grammar(spec)
    compiler = grammar.GrammarCompiler(tokenizer=None, vocab_size=10, stop_token_ids=[0])
    with pytest.raises(ValueError, match="xgrammar"):
        compiler.compile(spec)
