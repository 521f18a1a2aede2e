"""Every command line `baton up` builds (baton/cluster/plan.py) parsed by the role's own
parser: baton/ may not import the services, so this is where a renamed or dropped flag on
either side fails, and where each `baton up` flag is seen to reach the role's config."""
from __future__ import annotations

import pytest

from baton.cluster.plan import decode_args, gateway_args, gateway_env, prefill_args
from baton.cluster.up import build_parser
from decode_service.config import parse_args as decode_parse
from gateway.config import PrefillModeChoice, RoutingPolicy
from gateway.config import parse_args as gateway_parse
from prefill_service.config import parse_args as prefill_parse

EVERY_FLAG = ["--model", "tiny", "--transport", "grpc", "--dtype", "bfloat16",
              "--block-size", "8", "--max-model-len", "512", "--num-blocks", "64",
              "--kv-cache-memory-bytes", "1048576", "--min-remote-tokens", "24",
              "--log-level", "INFO", "--routing", "kv", "--grpc-port", "0",
              "--api-key", "sekret-k", "--port", "8123", "--host", "127.0.0.2", "--shutdown-grace-s", "7",
              "--kv-host-tier-bytes", "4096", "--kv-disk-tier-dir", "/tmp/t",
              "--kv-disk-tier-bytes", "8192", "--slo-ttft-ms", "1500",
              "--kv-store-url", "mooncake://127.0.0.1:5", "--kv-store-segment-bytes", "4096"]


@pytest.mark.parametrize("argv", [[], ["--mode", "colocated"], EVERY_FLAG])
def test_worker_argv_parses_with_the_workers_parsers(argv):
    up = build_parser().parse_args(argv)
    for cfg in (prefill_parse(prefill_args(up)), decode_parse(decode_args(up))):
        assert (cfg.server.host, cfg.server.port, cfg.server.drain_seconds) == ("127.0.0.1", 0, 5)
        assert cfg.transport == up.transport and cfg.server.log_level == up.log_level
        engine = cfg.engine
        assert engine.model == up.model and engine.max_model_len == up.max_model_len
        assert engine.dtype == (up.dtype or "float32")
        assert engine.cache.block_size == (up.block_size or 16)
        assert engine.cache.num_blocks == up.num_blocks
        if up.kv_cache_memory_bytes is not None:
            assert engine.cache.kv_cache_memory_bytes == up.kv_cache_memory_bytes
        if up.kv_host_tier_bytes is not None:
            assert (engine.cache.kv_host_tier_bytes, engine.cache.kv_disk_tier_dir,
                    engine.cache.kv_disk_tier_bytes) == (4096, "/tmp/t", 8192)
        assert engine.cache.kv_store_url == up.kv_store_url
        if up.kv_store_segment_bytes is not None:
            assert engine.cache.kv_store_segment_bytes == up.kv_store_segment_bytes
    decode = decode_parse(decode_args(up))
    if up.min_remote_tokens is not None:
        assert decode.min_remote_tokens == up.min_remote_tokens


@pytest.mark.parametrize("argv", [[], EVERY_FLAG])
@pytest.mark.parametrize("prefill", [["127.0.0.1:2", "127.0.0.1:3"], []])
def test_gateway_argv_parses_with_the_gateway_parser(argv, prefill):
    up = build_parser().parse_args(argv)
    gateway_argv = gateway_args(up, ["127.0.0.1:1"], prefill)
    # the API key travels in the environment, never on the command line (`ps`)
    assert "--api-key" not in gateway_argv
    assert up.api_key is None or up.api_key not in " ".join(gateway_argv)
    cfg = gateway_parse(gateway_argv, environ=gateway_env({}, up.api_key))
    assert (cfg.model, cfg.host, cfg.port, cfg.log_level) == (up.model, up.host, up.port,
                                                             up.log_level)
    assert cfg.router.policy == RoutingPolicy(up.routing)
    assert list(cfg.decode) == ["127.0.0.1:1"] and list(cfg.prefill) == prefill
    if not prefill:
        assert cfg.prefill_mode == PrefillModeChoice.LOCAL
    assert (cfg.grpc_port, cfg.api_key) == (up.grpc_port, up.api_key)
    assert (cfg.max_model_len, cfg.block_size) == (up.max_model_len, up.block_size)
    assert cfg.shutdown_grace_s == up.shutdown_grace_s
    assert cfg.slo_ttft_ms == up.slo_ttft_ms  # None (admission off) unless given


def test_a_bad_kv_store_url_is_refused_before_start():
    from baton.cluster.flags import bad_flags
    assert "--kv-store-url" in bad_flags(build_parser().parse_args(
        ["--kv-store-url", "http://127.0.0.1:5"]))
    assert bad_flags(build_parser().parse_args(["--kv-store", "mooncake"])) is None
