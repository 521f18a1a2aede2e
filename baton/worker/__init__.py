"""What every serving process shares:

    process       the process entry, logs, signals, the READY line (light: the gateway too)
    flags         the worker flags and configs (EngineConfig, ServerConfig, RoleConfig)
    start         the one start path of a worker role (start_worker, WorkerServer)
    async_engine  the engine's thread, bridged to asyncio
    wire          proto ⇄ engine translations (SamplingParams, logprobs, WorkerStats)
    stats_rpc     the GetStats RPC both roles answer
    validate      the checks every worker applies to a request before any work
    vllm_metrics  vLLM's metric names beside Baton's own
    healthcheck   `python -m baton.worker.healthcheck HOST:PORT` (gRPC health probe)
"""
