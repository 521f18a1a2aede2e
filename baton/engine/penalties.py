"""Logit bias and repetition, frequency and presence penalties, applied to a step's logits
before temperature and filtering, for the rows that ask for them.

Semantics follow vLLM (`apply_penalties` in vllm/model_executor/layers/utils.py, applied by
its v1 `Sampler` after the logit bias and before temperature), which follows the OpenAI API
for presence/frequency (https://platform.openai.com/docs/advanced-usage, "frequency and
presence penalties") and CTRL (Keskar et al. 2019, eq. 1) for the repetition penalty:

    logit_bias:          l[t] += bias[t]
    repetition_penalty:  for t in prompt ∪ output:  l[t] = l[t] / r if l[t] > 0 else l[t] * r
    frequency_penalty:   l[t] -= f * count_output(t)
    presence_penalty:    l[t] -= p * (count_output(t) > 0)

min_tokens (vLLM's MinTokensLogitsProcessor): before a request has generated min_tokens
tokens, its eos and stop_token_ids get logit -inf (`apply_bans`), so it writes on rather than
sampling an end it would have to ignore.

Only the rows with something to apply are touched (gathered, processed, written back), so
every other row's logits are bit-for-bit unchanged. Logprobs are reported from the raw
logits (vLLM's default `raw_logprobs`); the penalized ones decide the token.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from baton.sampling_params import SamplingParams


def needs_token_history(params: Sequence[SamplingParams]) -> bool:
    """True when some row's penalty depends on its prompt or output tokens."""
    return any(p.has_penalties for p in params)


def apply_logit_processing(logits: Tensor, params: Sequence[SamplingParams],
                           history: Sequence[tuple[Sequence[int], Sequence[int]]] | None
                           ) -> Tensor:
    """logits [B, V] float32 (not modified); history[i] = (prompt ids, output ids) of row i,
    required when `needs_token_history(params)`. Returns the processed logits (the same
    tensor when no row asks for anything)."""
    rows = [i for i, p in enumerate(params) if p.logit_bias or p.has_penalties]
    if not rows:
        return logits
    out = logits.clone()
    for i in rows:
        p = params[i]
        if p.logit_bias:
            ids = torch.tensor(list(p.logit_bias), dtype=torch.int64, device=logits.device)
            bias = torch.tensor(list(p.logit_bias.values()), dtype=logits.dtype,
                                device=logits.device)
            out[i].index_add_(0, ids, bias)
        if p.has_penalties:
            assert history is not None, "penalties need the rows' prompt and output ids"
            prompt, output = history[i]
            out[i] = apply_penalties_ref(out[i], prompt, output, p.presence_penalty,
                                         p.frequency_penalty, p.repetition_penalty)
    return out


def apply_penalties_ref(logits: Tensor, prompt_token_ids: Sequence[int],
                        output_token_ids: Sequence[int], presence: float, frequency: float,
                        repetition: float) -> Tensor:
    """One row: logits [V] float32 → penalized logits [V] (a new tensor). Formulas in the
    module docstring; repetition counts prompt and output tokens, the others output only."""
    vocab = logits.shape[0]
    device = logits.device
    counts = torch.zeros(vocab, dtype=logits.dtype, device=device)
    if output_token_ids:
        out_ids = torch.tensor(list(output_token_ids), dtype=torch.int64, device=device)
        counts.index_add_(0, out_ids, torch.ones(len(out_ids), dtype=logits.dtype,
                                                 device=device))
    result = logits
    if repetition != 1.0:
        seen = counts > 0
        if prompt_token_ids:
            seen[torch.tensor(list(prompt_token_ids), dtype=torch.int64, device=device)] = True
        penalized = torch.where(logits > 0, logits / repetition, logits * repetition)
        result = torch.where(seen, penalized, logits)
    if frequency:
        result = result - frequency * counts
    if presence:
        result = result - presence * (counts > 0).to(logits.dtype)
    return result


def apply_bans(logits: Tensor, banned: Sequence[frozenset[int]] | None,
               owned: bool = False) -> Tensor:
    """logits [B, V] float32; banned[i]: token ids row i may not sample (min_tokens), or
    None when no row bans any. Returns logits with those set to -inf (a copy unless `owned`
    or nothing is banned)."""
    rows = [i for i, b in enumerate(banned or ()) if b]
    if not rows:
        return logits
    out = logits if owned else logits.clone()
    for i in rows:
        ids = torch.tensor(sorted(banned[i]), dtype=torch.int64, device=logits.device)
        out[i].index_fill_(0, ids[ids < out.shape[1]], float("-inf"))
    return out
