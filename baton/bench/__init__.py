"""`baton bench`: replay agent traffic against an OpenAI-compatible gateway and report.

The benchmark is a client, like any agent harness: it speaks HTTP (`/v1/chat/completions`
or `/v1/completions`, streaming; `/version`, `/v1/models` and `/metrics/workers` to describe
the server) to a gateway and never imports a service.

    workload.py   Turn / Session / Child: what a trace is, before it is rendered
    loaders.py    τ-bench, SWE-agent (real text); Mooncake FAST'25, AgentX/WEKA (block hashes)
    synthetic.py  a seeded AgentX-like generator
    tokens.py     token counting (served model's tokenizer, or chars/4) and block synthesis
    prepare.py    Session → exact request bodies + token counts + theoretical prefix hit
    client.py     one streaming request → RequestRecord (timings, usage)
    runner.py     closed loop (N live session trees) and open loop (trace timestamps)
    metrics.py    TTFT / TPOT / ITL / E2E percentiles, throughput, goodput, prefix hit, by turn
    worker_poll.py  the workers' queues and KV usage during a run (GET /metrics/workers)
    server_info.py  this client's version/commit; the server's GET /version and /v1/models
    report.py     report.json, the per-request JSONL, the printed tables
    plots.py      the PNG plots, titled with the run's configuration
    local.py      start/stop a local cluster (`baton up`) or the transformers baseline
    compare.py    `baton bench compare`: several configurations on one workload
    agentx_cli.py `baton bench agentx` (and `compare --driver agentx`): the public AgentX
                  harness sends the workload; agentx.py finds and runs it, agentx_trace.py
                  converts sessions to its trace files, agentx_results.py reads its exports
    hf_baseline.py  a plain transformers server, one request at a time
    cli.py        argument parsing: `baton bench ...`
"""
