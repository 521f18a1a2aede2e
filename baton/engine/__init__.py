"""The engine: one model, one paged KV cache, one scheduler, stepped by its owner.

    llm_engine       LLMEngine: add, abort, step, stats (what services may call)
    request          Request and the one list of its statuses (RequestStatus)
    scheduler        every status transition: waiting, running, preempted, remote-KV waits
    schedule_policy  admission orders of the waiting queue (fcfs, shortest-first with aging)
    sched_output     ScheduledRequest, SchedulerOutput: what a step runs
    kv_cache         KVCacheManager: which blocks each request uses, chained hashes, hits
    block_pool       Block, BlockPool: ref counts, the LRU free queue, the hash → block map
    kv_tier          KVTier: blocks the pool evicts go to host memory, then disk; hits load back
    tier_store       HostTier (preallocated slots), DiskTier (one CRC-checked file a block)
    kv_store         StoreTier: finished requests' blocks in the cluster's Mooncake Store,
                     loaded by any worker's prefix walk (store_client: the client, breaker)
    tier_stack       TierStack: the tier and the store behind one interface (tiers_for)
    model_runner     one batched forward over a step's rows, then sampling
    sampler          temperature, top-k/p, min-p, seeded draws, logprobs (+ penalties.py)
    grammar          structured outputs: compiled grammars (xgrammar), per-request matchers,
                     the masks of constrained rows
    detokenizer      incremental text and stop strings
    model_limits     a model's context length and EOS ids
    stats            EngineCounts, EngineStats: all a worker may read of its engine
    remote_kv        decode role: prompt KV written by a prefill worker; holds of blocks
    block_holds      prefill role: blocks held after the first token until sent
"""
