"""Prompt logprobs (vLLM's `prompt_logprobs`): the logprob of each prompt token after the
first under the model, its rank and the top k, computed as the prompt's chunks run.

A request that asks (`Request.prompt_logprobs` is a list) reads no cached prefix
(scheduler.py), so its chunks cover the prompt from position 0 on, and position p's hidden
state predicts prompt token p + 1:

    a chunk of R: positions start .. start + n - 1, hidden rows off .. off + n - 1
    wanted:       p in [len(R.prompt_logprobs), min(start + n, P - 1))    P = prompt length
    each p:       lm_head(hidden[off + p - start]) → TokenLogprob(prompt[p + 1], logprob,
                  top k, rank)

Positions already filled (a preempted request computes its prompt again) are skipped; the
last prompt position predicts the first output token and is the sampler's. Logprobs are of
the raw logits (no temperature, penalties or bias: vLLM's default `raw_logprobs`), from
the sampler's own `token_logprobs`, so a prompt token's entry has the same numbers as it
would as a sampled one. lm_head runs over SLICE positions at a time ([SLICE, vocab] float32
at most at once).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch

from baton.engine.sampler import logprob_lists, token_logprobs
from baton.engine.sched_output import ScheduledRequest

SLICE = 256


class _Asked(NamedTuple):
    """What token_logprobs reads of a row's params: how many top logprobs."""

    logprobs: int


def fill_prompt_logprobs(batch: Sequence[ScheduledRequest], hidden: torch.Tensor,
                         compute_logits: Callable[[torch.Tensor], torch.Tensor],
                         to_device: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """Extend each asking request's `prompt_logprobs` with the positions its row of this
    step computed. batch: the step's rows in hidden order (each `num_new_tokens` rows);
    hidden: [sum of num_new_tokens, hidden_size], the model's output before lm_head;
    compute_logits: hidden rows [N, hidden_size] → logits [N, vocab] float32. Call before
    the engine advances num_computed_tokens."""
    off = 0
    for s in batch:
        r, start = s.request, s.request.num_computed_tokens
        out = r.prompt_logprobs
        if out is not None and start <= len(out):  # start > len: a gap, never (no cache)
            end = min(start + s.num_new_tokens, r.num_prompt_tokens - 1)
            k = r.sampling_params.prompt_logprobs
            for a in range(len(out), end, SLICE):
                b = min(a + SLICE, end)
                rows = torch.arange(off + a - start, off + b - start)
                logits = compute_logits(hidden[to_device(rows)])
                targets = to_device(torch.tensor(r.prompt_token_ids[a + 1:b + 1]))
                sampled = token_logprobs(logits, targets, [_Asked(k)] * (b - a))
                out.extend(lps[0] for lps in logprob_lists(sampled, [k] * (b - a),
                                                           (1,) * (b - a)))
        off += s.num_new_tokens
