"""What the rest of a worker may read of its engine: one snapshot type, no internals.

Services, wire messages and metrics read `EngineStats` (taken on the engine thread) or
`EngineCounts` (a few lengths, safe to read from any thread, e.g. a Prometheus scrape).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

from baton.engine.kv_source import KVSource, Spans

if TYPE_CHECKING:
    from collections.abc import Collection

    from baton.engine.kv_cache import KVCacheManager
    from baton.engine.kv_tier import TierCounts
    from baton.engine.request import Request


@dataclass
class Totals:
    """Cumulative counts since the engine started; only the engine thread adds to them.

    num_preemptions: requests preempted (blocks freed, to be recomputed).
    num_time_slices: of those, preempted for a waiting request (time_slice.py).
    prefix_cache_queries / prefix_cache_hits: prompt tokens looked up in the prefix cache
    and, of those, tokens found, once per request at its first admission or remote-KV wait
    (as vLLM counts them, in tokens).
    prompt_tokens: prompt tokens of requests that got their first output token.
    generation_tokens: output tokens appended (a remote prefill's first token included).
    cached_tokens_by_source: of prefix_cache_hits, tokens by where this engine found them
    (its pool, or loaded from a tier: kv_source.py); their sum is prefix_cache_hits.
    spec_*: speculative decoding as vLLM counts it: verified rows that carried drafts,
    drafted tokens, drafted tokens accepted (not counting the row's last, sampled token),
    and per draft position how many were accepted (spec_accepted_per_pos[i]: position i).
    """

    num_preemptions: int = 0
    num_time_slices: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    cached_tokens_by_source: dict[KVSource, int] = field(
        default_factory=lambda: dict.fromkeys(KVSource, 0))
    spec_drafts: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_accepted_per_pos: list[int] = field(default_factory=list)

    def count_spec(self, num_drafted: int, num_accepted: int) -> None:
        """A verified decode row: `num_drafted` drafts, the first `num_accepted` accepted."""
        if not num_drafted:
            return
        self.spec_drafts += 1
        self.spec_draft_tokens += num_drafted
        self.spec_accepted_tokens += num_accepted
        per = self.spec_accepted_per_pos
        if len(per) < num_drafted:
            per.extend([0] * (num_drafted - len(per)))
        for i in range(num_accepted):
            per[i] += 1

    def count_cached_spans(self, spans: Spans) -> None:
        """A request's prefix hit, by source (its spans, kv_source.py)."""
        for source, n in spans:
            self.cached_tokens_by_source[source] += n

    def count_output_token(self, req: Request) -> None:
        """One output token appended to `req` (its first also counts its prompt)."""
        self.generation_tokens += 1
        if len(req.output_token_ids) == 1:
            self.prompt_tokens += req.num_prompt_tokens


class EngineCounts(NamedTuple):
    """Queue and pool sizes (requests, blocks) and the cumulative `Totals`; each a single
    read, so a metrics thread may take them while the engine steps (each is exact, the set
    is not atomic). kv_tiers: each KV tier's size and moves (kv_tier.TierCounts: blocks,
    bytes, hits, misses, bytes and seconds moved); kv_tier_recomputed_blocks: tier blocks
    found unusable (corrupt file) and recomputed; cached_tokens_by_source: (source, tokens)
    of Totals.cached_tokens_by_source; spec_*: Totals' speculative decoding counters."""

    num_running: int
    num_waiting: int  # queued for local prefill (remote-KV waits not included)
    num_waiting_for_remote_kv: int
    num_free_blocks: int
    num_total_blocks: int
    num_preemptions: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    kv_tiers: tuple[TierCounts, ...] = ()
    kv_tier_recomputed_blocks: int = 0
    cached_tokens_by_source: tuple[tuple[KVSource, int], ...] = ()
    spec_drafts: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_accepted_per_pos: tuple[int, ...] = ()


class EngineStats(NamedTuple):
    """A consistent snapshot (take it on the engine thread: `AsyncEngine.call`).

    num_waiting_tokens: prompt tokens still to compute over waiting and running requests (a
    waiting request's less the prefix the pool holds for it now: KVCacheManager.peek_cached_tokens).
    num_free_blocks counts blocks no live request holds (cached-but-evictable included).
    load: max(KV usage, running / max_num_seqs) + waiting / max_num_seqs (≥ 0; 1 ≈ full).
    block_hashes: every cached block's chained hash, when asked for (else empty).
    prefill_tokens_per_s: prompt tokens per second of step time, measured over recent steps
    (prefill_rate.py; 0.0 until measured).
    """

    counts: EngineCounts
    num_waiting_tokens: int
    num_cached_blocks: int
    kv_usage: float
    max_num_seqs: int
    load: float
    block_hashes: tuple[int, ...] = ()
    prefill_tokens_per_s: float = 0.0


def snapshot(waiting: Collection[Request], running: Collection[Request], kv: KVCacheManager,
             max_num_seqs: int, counts: EngineCounts, include_block_hashes: bool,
             prefill_tokens_per_s: float = 0.0) -> EngineStats:
    """EngineStats of a scheduler's queues and its KV manager (engine thread)."""
    # a waiting request's prefix hit is not applied until it is scheduled (num_computed_tokens
    # 0 till then): counted from the pool now, or an agent's burst of continuation turns
    # (each a short suffix after a long cached prefix) weighs its whole prompts, and the P/D
    # decider prices the local queue several times too long (BENCHMARKS.md, stop 36)
    waiting_tokens = sum(
        max(0, r.num_prompt_tokens - max(r.num_computed_tokens,
                                         kv.peek_cached_tokens(r.request_id, r.prompt_token_ids)))
        for r in waiting)
    waiting_tokens += sum(max(0, r.num_prompt_tokens - r.num_computed_tokens) for r in running)
    seqs = max_num_seqs
    load = max(kv.usage, len(running) / seqs) + len(waiting) / seqs
    hashes = tuple(kv.cached_block_hashes()) if include_block_hashes else ()
    return EngineStats(counts, waiting_tokens, kv.num_cached_blocks, kv.usage, seqs, load,
                       hashes, prefill_tokens_per_s)


def counts_of(running: Collection[Request], waiting: Collection[Request],
              remote_waits: Collection[Request], kv: KVCacheManager,
              totals: Totals) -> EngineCounts:
    """EngineCounts of a scheduler's queues, its KV manager and its totals (len() reads)."""
    t, tier = totals, kv.tier
    return EngineCounts(len(running), len(waiting), len(remote_waits), kv.num_free_blocks,
                        kv.num_blocks, t.num_preemptions, t.prefix_cache_queries,
                        t.prefix_cache_hits, t.prompt_tokens, t.generation_tokens,
                        tier.counts() if tier is not None else (),
                        tier.recomputed_blocks if tier is not None else 0,
                        tuple(t.cached_tokens_by_source.items()), t.spec_drafts,
                        t.spec_draft_tokens, t.spec_accepted_tokens,
                        tuple(t.spec_accepted_per_pos))
