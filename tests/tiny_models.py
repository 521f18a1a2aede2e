"""Tiny random Llama-family models built in-process (no hub, no real weights).

`build_tiny_model(folder, arch)` trains a small byte-level BPE tokenizer on a fixed corpus,
builds a random transformers model whose vocabulary equals the tokenizer's, and saves both
(config.json, model.safetensors, tokenizer.json, chat template) into `folder`.
Weights use a larger init scale than usual so logits are peaked and greedy argmax is not a
near-tie (token-exact comparisons stay meaningful in fp32).
"""
from __future__ import annotations

from pathlib import Path

import torch

CHAT_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + "
    "(message['content'] or '') + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

_CORPUS = [
    "The quick brown fox jumps over the lazy dog. ",
    "Agents call tools, read results and call tools again. ",
    "def add(a, b):\n    return a + b\n",
    "Flight UA 123 from SFO to JFK departs at 10:45. Baggage allowance: two bags. ",
    "Prefill computes the KV cache; decode generates tokens one at a time. ",
    "héllo wörld, naïve café, 日本語のテキスト, emoji 🚀🔥 ",
    '{"name": "get_weather", "arguments": {"city": "Paris"}} ',
]


def train_tokenizer(vocab_size: int = 384):
    """A byte-level BPE `PreTrainedTokenizerFast` with ChatML special tokens (ids 0..2)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(_CORPUS * 20, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def build_tiny_model(folder: Path | str, arch: str = "llama", seed: int = 0) -> Path:
    """Build and save a tiny random model of `arch` in {'llama', 'llama_d32', 'qwen2', 'qwen3',
    'mistral'}.

    Returns the folder. Raises ValueError for an unknown arch.
    """
    from transformers import (
        LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM,
        Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM,
    )

    folder = Path(folder)
    tok = train_tokenizer()
    vocab = len(tok)
    common = dict(
        vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        max_position_embeddings=1024, rms_norm_eps=1e-6, initializer_range=0.08,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    if arch == "llama":
        cfg = LlamaConfig(num_attention_heads=4, num_key_value_heads=2,
                          tie_word_embeddings=False, **common)
        cls = LlamaForCausalLM
    elif arch == "llama_d32":  # head_dim 32: the AMX prefill attention's shapes (D % 32 == 0)
        cfg = LlamaConfig(num_attention_heads=2, num_key_value_heads=1,
                          tie_word_embeddings=False, **common)
        cls = LlamaForCausalLM
    elif arch == "mistral":
        cfg = MistralConfig(num_attention_heads=4, num_key_value_heads=4,
                            tie_word_embeddings=False, sliding_window=None, **common)
        cls = MistralForCausalLM
    elif arch == "qwen2":
        cfg = Qwen2Config(num_attention_heads=4, num_key_value_heads=1,
                          tie_word_embeddings=True, use_sliding_window=False, **common)
        cls = Qwen2ForCausalLM
    elif arch == "qwen3":
        cfg = Qwen3Config(num_attention_heads=6, num_key_value_heads=2, head_dim=16,
                          tie_word_embeddings=False, use_sliding_window=False, **common)
        cls = Qwen3ForCausalLM
    else:
        raise ValueError(f"unknown tiny arch {arch!r}")
    torch.manual_seed(seed)
    model = cls(cfg).eval()
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder
