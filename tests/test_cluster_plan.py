"""Every command line `baton up` builds (baton/cluster/plan.py) parsed by the role's own
parser, every flag declared once (baton/flagspec.py): a role flag given to `baton up`
reaches exactly the roles that take it, and no parser's default differs from its
config dataclass's."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from baton.cluster.flags import ClusterConfig, bad_flags, parse_up_args, role_flags
from baton.cluster.plan import decode_args, gateway_args, gateway_env, prefill_args
from baton.config import EngineConfig
from baton.flagspec import specs
from baton.gateway_config import TOOL_CALL_PARSERS
from decode_service.config import DecodeConfig
from decode_service.config import parse_args as decode_parse
from gateway.config import GatewayConfig, PrefillModeChoice, RoutingPolicy
from gateway.config import parse_args as gateway_parse
from gateway.tool_parsers import TOOL_PARSERS
from prefill_service.config import PrefillConfig
from prefill_service.config import parse_args as prefill_parse

EVERY_FLAG = ["--model", "tiny", "--transport", "grpc", "--dtype", "bfloat16",
              "--block-size", "8", "--max-model-len", "512", "--num-blocks", "64",
              "--kv-cache-memory-bytes", "1048576", "--min-remote-tokens", "24",
              "--log-level", "INFO", "--routing", "kv", "--grpc-port", "0", "--api-key", "k",
              "--port", "8123", "--host", "127.0.0.2", "--shutdown-grace-s", "7",
              "--kv-host-tier-bytes", "4096", "--kv-disk-tier-dir", "/tmp/t",
              "--kv-disk-tier-bytes", "8192", "--slo-ttft-ms", "1500",
              "--kv-store-url", "mooncake://127.0.0.1:5", "--kv-store-segment-bytes", "4096",
              "--max-num-seqs", "12", "--schedule-policy", "fcfs",
              "--local-prefill-itl-budget-ms", "80", "--local-prefill-idle-budget-ms", "0",
              "--tool-call-parser", "mistral", "--served-model-name", "m", "--no-prefix-caching",
              "--lease-seconds", "9", "--max-inflight", "7",
              "--speculative-method", "suffix", "--num-speculative-tokens", "5",
              "--spec-benchmark-synthetic-acceptance", "0.9,0.5"]


@pytest.mark.parametrize("argv", [[], ["--mode", "colocated"], EVERY_FLAG])
def test_worker_argv_parses_with_the_workers_parsers(argv):
    up = parse_up_args(argv)
    for cfg in (prefill_parse(prefill_args(up)), decode_parse(decode_args(up))):
        assert (cfg.server.host, cfg.server.port, cfg.server.drain_seconds) == ("127.0.0.1", 0, 5)
        assert cfg.transport == up.transport and cfg.server.log_level == up.log_level
        engine = cfg.engine
        assert engine.model == up.model and engine.max_model_len == up.max_model_len
        assert engine.dtype == up.dtype
        assert engine.cache.block_size == (up.block_size or 16)
        assert engine.cache.num_blocks == up.num_blocks
        assert engine.cache.enable_prefix_caching == up.prefix_caching
        assert engine.scheduler.max_num_seqs == up.max_num_seqs
        assert engine.cache.kv_store_url == up.kv_store_url
        assert cfg.served_model_name == up.served_model_name
        spec = engine.speculative
        assert spec.method == up.speculative_method  # None: off unless asked
        if up.speculative_method is not None:
            assert (spec.num_speculative_tokens, spec.synthetic_acceptance) == (5, (0.9, 0.5))
    decode = decode_parse(decode_args(up))
    assert decode.min_remote_tokens == up.min_remote_tokens
    assert decode.local_prefill_itl_budget_ms == up.local_prefill_itl_budget_ms
    assert prefill_parse(prefill_args(up)).lease_seconds == up.lease_seconds


@pytest.mark.parametrize("argv", [[], EVERY_FLAG])
@pytest.mark.parametrize("mode", ["disaggregated", "colocated"])
def test_gateway_argv_parses_with_the_gateway_parser(argv, mode, tmp_path):
    up = parse_up_args([*argv, "--mode", mode])
    cfg = gateway_parse(gateway_args(up, tmp_path / "workers.json"),
                        environ=gateway_env({}, up.api_key))
    assert (cfg.model, cfg.host, cfg.port, cfg.log_level) == (up.model, up.host, up.port,
                                                             up.log_level)
    assert cfg.router.policy == RoutingPolicy(up.routing)
    assert cfg.workers_file == str(tmp_path / "workers.json") and not cfg.decode
    assert (cfg.prefill_mode == PrefillModeChoice.LOCAL) == (mode == "colocated")
    assert (cfg.grpc_port, cfg.api_key) == (up.grpc_port, up.api_key)
    assert (cfg.max_model_len, cfg.block_size) == (up.max_model_len, up.block_size)
    assert cfg.shutdown_grace_s == up.shutdown_grace_s
    assert cfg.slo_ttft_ms == up.slo_ttft_ms  # None (admission off) unless given
    assert (cfg.tool_call_parser, cfg.max_inflight) == (up.tool_call_parser, up.max_inflight)


def test_the_api_key_never_reaches_a_command_line():
    up = parse_up_args(["--api-key", "s3cret"])
    for argv in (prefill_args(up), decode_args(up), gateway_args(up, Path("workers.json"))):
        assert "s3cret" not in " ".join(argv)
    assert gateway_env({"X": "1"}, up.api_key) == {"X": "1", "BATON_API_KEY": "s3cret"}


def test_a_flag_reaches_only_the_roles_that_take_it():
    up = parse_up_args(["--lease-seconds", "9", "--max-n", "3", "--max-inflight", "7"])
    assert "--lease-seconds" in prefill_args(up) and "--lease-seconds" not in decode_args(up)
    assert "--max-n" in decode_args(up) and "--max-n" not in prefill_args(up)
    gateway = gateway_args(up, Path("workers.json"))
    assert "--max-inflight" in gateway and "--lease-seconds" not in gateway
    assert "--max-n" in gateway  # the gateway refuses what decode would (one limit)


@pytest.mark.parametrize("cls,parse", [(PrefillConfig, prefill_parse),
                                       (DecodeConfig, decode_parse),
                                       (GatewayConfig, gateway_parse)])
def test_every_parser_default_is_its_config_default(cls, parse):
    """A default lives in one place: a role started with no flags runs its config
    dataclass's defaults, nested ones included (a hand-written parser default fails it)."""
    if cls is GatewayConfig:
        assert parse(["--decode", "127.0.0.1:1"], environ={}) == cls(decode=("127.0.0.1:1",))
    else:
        assert parse([]) == cls()


def test_cluster_flags_cover_every_role_flag_once():
    """`baton up` offers each role's cluster-wide flags, one flag per name."""
    offered = {s.dest for flags in role_flags().values() for s in flags.values()}
    own = {s.dest for s in specs(ClusterConfig)}
    for cls in (PrefillConfig, DecodeConfig, GatewayConfig):
        for s in specs(cls):
            if s.flag.cluster:
                assert s.dest in offered | own, s.option
    assert {s.dest for s in specs(EngineConfig) if s.flag.cluster} <= offered | own


def test_production_defaults():
    """What `baton up` and every role start with unless told otherwise."""
    up = parse_up_args([])
    assert (up.pin, up.schedule_policy, up.prefill_target_tokens) == ("share", "shortest_first",
                                                                      256)
    assert up.dtype == "auto" and up.min_remote_tokens is None


def test_the_tool_parser_choices_are_the_gateways_parsers():
    assert set(TOOL_CALL_PARSERS) == set(TOOL_PARSERS)


def test_bad_values_of_role_flags_are_refused_before_start():
    up = parse_up_args(["--kv-store-url", "http://127.0.0.1:5"])
    assert "decode: KV store URL" in (bad_flags(up, {"decode": decode_args(up)}) or "")
    up = parse_up_args(["--max-num-seqs", "0"])
    assert "max_num_seqs" in bad_flags(up, {"prefill": prefill_args(up)})
    assert bad_flags(parse_up_args(["--kv-store", "mooncake"])) is None


def test_a_folder_is_served_under_its_name(tmp_path):
    folder = tmp_path / "MyModel-7B"
    cfg = gateway_parse(["--model", str(folder) + "/", "--decode", "127.0.0.1:1"], environ={})
    assert cfg.served_model_name == "MyModel-7B"
    cfg = gateway_parse(["--model", str(folder), "--served-model-name", "x",
                         "--decode", "127.0.0.1:1"], environ={})
    assert cfg.served_model_name == "x"
    assert dataclasses.replace(cfg, served_model_name="").served_model_name == "MyModel-7B"
