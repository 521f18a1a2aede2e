"""The numerical oracle: transformers' own model, greedy, no KV cache (full recompute)."""
from __future__ import annotations

from functools import lru_cache

import torch


@lru_cache(maxsize=8)
def hf_model(folder: str, dtype: torch.dtype = torch.float32):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).eval()


@torch.no_grad()
def hf_greedy(folder, prompt_ids: list[int], max_tokens: int, eos_ids=()) -> list[int]:
    """Greedy continuation of `prompt_ids` by the transformers model in `folder` (fp32).

    Stops after `max_tokens` or at a token in `eos_ids` (included, as generate does).
    """
    model = hf_model(str(folder))
    ids = torch.tensor([prompt_ids])
    out: list[int] = []
    for _ in range(max_tokens):
        token = int(model(ids).logits[0, -1].argmax())
        out.append(token)
        if token in eos_ids:
            break
        ids = torch.cat([ids, torch.tensor([[token]])], dim=1)
    return out
