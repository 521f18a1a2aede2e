"""The engine: one model, one paged KV cache, one scheduler, stepped by its owner.

    llm_engine    LLMEngine: add, abort, step, stats (what services may call)
    request       Request and the one list of its statuses (RequestStatus)
    scheduler     every status transition: waiting, running, preempted, remote-KV waits
    kv_cache      KVCacheManager: which blocks each request uses, chained hashes, prefix hits
    block_pool    Block, BlockPool: ref counts, the LRU free queue, the hash → block map
    model_runner  one batched forward over a SchedulerOutput, then sampling
    sampler       temperature, top-k/p, min-p, seeded draws, logprobs
    detokenizer   incremental text and stop strings
"""
