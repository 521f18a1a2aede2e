"""The gRPC channel/server options of every internal hop, defined once (a leaf module: it
imports nothing, so the gateway, the workers and baton.transfer can all use it).

    worker servers, decode → prefill peers, prefill → decode KV pushes   CHANNEL_OPTIONS
    gateway → worker channels (idle between polls)                       with_options(...)
"""
from __future__ import annotations

Options = tuple[tuple[str, int], ...]

# Messages ≤ 16 MiB each way (KV chunks stay ≤ 2 MiB; a stats snapshot with every cached
# block hash of a large pool fits). Keepalive notices a dead peer during long calls.
# Reconnect backoff is capped at 0.5 s (gRPC's default grows to 120 s): a call on a channel
# waiting out its backoff fails at once (UNAVAILABLE), so a peer restarted on the same
# address is used again within half a second of its READY, not minutes after it came back
# (issue 27). The price: two connection attempts a second to a peer that is down, each
# refused at once (or, to a host that drops packets, one attempt at a time).
CHANNEL_OPTIONS: Options = (
    ("grpc.max_send_message_length", 16 << 20),
    ("grpc.max_receive_message_length", 16 << 20),
    ("grpc.keepalive_time_ms", 20_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 500),
)


def with_options(base: Options, **overrides: int) -> Options:
    """`base` with some options replaced or added; keyword `keepalive_time_ms` names
    `grpc.keepalive_time_ms` (the `grpc.` prefix is implied)."""
    merged = dict(base)
    merged.update({f"grpc.{name}": value for name, value in overrides.items()})
    return tuple(merged.items())
