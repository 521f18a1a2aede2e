"""Baton's gateway: the OpenAI HTTP API and a gRPC front in front of the decode workers.

    client ──HTTP/SSE──▶ http_api ─┐
    client ──gRPC──────▶ grpc_front ┴─▶ prep_pool ──────▶ dispatch ─▶ decode
                  (other processes: parse, limits,    router (session, KV overlap, load)
                   template, tokenize, block hashes)  ◀─ workers (health + stats polling)

Modules: config (flags), prep_pool (preparation off the event loop, with a deadline),
prepare (raw body → checked, tokenized prompts), limits (tools, schema size and depth),
prompts (tokenizer, chat template), piece_cache (tokenization reused across a session's
turns), protocol (request bodies), structured (response_format, forced tool calls, schema
checks), router (pure routing), workers (pool, health, stats, DNS), prefix_hashes (block
hashes reused across turns), dispatch (one request's trip, retries, cancellation), responses
(OpenAI bodies and SSE chunks), tool_calls (Hermes-style parsing), asgi (API key, body limit,
disconnects), http_api (routes), grpc_front, metrics, server (assembly). The gateway holds no
KV; its routing table is soft state rebuilt from worker stats. It imports only protos/ and
baton's light pieces, never a worker's internals.
"""
