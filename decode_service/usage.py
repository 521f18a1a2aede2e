"""A request's prompt usage on the decode worker: the tokens nobody computed for it, where
they came from, and the tokens computed although a worker held them.

    local prefill (or a failed remote one, recomputed here):
        cached = decode's own hit d, by decode's spans (its pool → DECODE_POOL, its tiers)
    remote prefill, prefill's hit p (it computes everything else, even blocks decode holds:
    those are simply not transferred):
        cached = p                   tokens [0, p) were computed by nobody
        by     = decode's spans over [0, min(d, p))  (decode's copy is the one used)
               + prefill's spans over [min(d, p), p)
        recomputed_held = max(0, d − p)   decode held them, prefill computed them again

    d = 48, p = 16:  cached 16 (DECODE_POOL 16), recomputed_held 32
    d = 16, p = 48:  cached 48 (DECODE_POOL 16, PREFILL_POOL or a prefill tier 32), 0
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from baton.engine.kv_source import skip, take, total
from baton.worker.wire import wire_spans
from protos import common_pb2, prefill_pb2


class PromptUsage(NamedTuple):
    """cached_tokens = sum(cached_by values); cached_by: common_pb2.KVSource → tokens."""

    cached_tokens: int
    cached_by: dict[int, int]
    recomputed_held_tokens: int

    def to_proto(self, prompt_tokens: int, completion_tokens: int) -> common_pb2.Usage:
        """The Usage message of this split."""
        return common_pb2.Usage(
            prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
            cached_tokens=self.cached_tokens, recomputed_held_tokens=self.recomputed_held_tokens,
            cached_by=[common_pb2.CachedTokens(source=s, num_tokens=n)
                       for s, n in sorted(self.cached_by.items())])


def _by_source(spans: Sequence[tuple[int, int]]) -> dict[int, int]:
    by: dict[int, int] = {}
    for s, n in spans:
        by[s] = by.get(s, 0) + n
    return by


def prompt_usage(decode_spans, remote: prefill_pb2.PrefillResponse | None) -> PromptUsage:
    """The split of the module docstring. decode_spans: decode's engine spans
    (Request.cached_spans); remote: the OK PrefillResponse when a prefill worker computed
    the prompt, else None."""
    mine = wire_spans(decode_spans, common_pb2.KV_SOURCE_DECODE_POOL)
    d = total(mine)
    if remote is None:
        return PromptUsage(d, _by_source(mine), 0)
    p = remote.num_cached_tokens
    theirs = tuple((c.source, c.num_tokens) for c in remote.cached_spans)
    if total(theirs) != p:  # an older prefill worker: no spans, its pool by default
        theirs = ((common_pb2.KV_SOURCE_PREFILL_POOL, p),)
    both = min(d, p)
    spans = take(mine, both) + skip(theirs, both)
    return PromptUsage(p, _by_source(spans), max(0, d - p))
