"""Prompt tokens a worker computes before a new request: its queue as the scheduler orders it.

    tokens_ahead(uncached, outstanding, polled)
      = Σ outstanding entries ≤ uncached          workers prefill shortest first
                                                  (schedule_policy.py)
      + min(CHUNK_TOKENS, largest entry > uncached)   a longer prompt's chunk may be in the
                                                      step in flight (prefill_target.py)
      + max(0, polled − Σ outstanding)            the worker's polled queue beyond what this
                                                  caller sent (others' work)

`outstanding`: uncached tokens of the requests this caller sent to the worker that have no
first token yet; `polled`: the worker's num_waiting_tokens from its last stats (aged by its
rate), which is as old as the poll and leaves out what was sent since: under a burst the
stats alone saw near-empty queues while TTFTs were ten times over. Shared by the gateway's
SLO admission (gateway/admission.py) and the decode worker's P/D decider
(decode_service/pd_choice.py), so both predict the same queue.
"""
from __future__ import annotations

from collections.abc import Sequence

CHUNK_TOKENS = 256  # workers' default --prefill-target-tokens: one step's prefill


def tokens_ahead(uncached: int, outstanding: Sequence[int], polled: int) -> int:
    """Tokens before a request of `uncached` prompt tokens (module docstring); ≥ 0."""
    shorter = sum(n for n in outstanding if n <= uncached)
    longer = max((n for n in outstanding if n > uncached), default=0)
    return shorter + min(CHUNK_TOKENS, longer) + max(0, polled - sum(outstanding))
