"""The default KV pool (baton/engine/kv_budget.py): a fraction of MemAvailable after the model
loads, at least one longest request, a clear error when that does not fit, one budget split
over `baton up`'s workers. Free memory is injected: nothing depends on this machine's."""
import json

import pytest

from baton import LLM
from baton.cluster.flags import parse_up_args
from baton.cluster.plan import decode_args, kv_bytes_per_worker, set_role_flag
from baton.engine.kv_budget import (
    FALLBACK_BYTES,
    KVBudgetError,
    auto_num_blocks,
    block_bytes_of,
    cluster_share,
    floor_blocks,
    mem_available_bytes,
    read_mem_available,
    weight_bytes,
)

MIB = 1 << 20
MEMINFO = "MemTotal:       24683584 kB\nMemFree:  1 kB\nMemAvailable:   1048576 kB\n"


def test_meminfo_is_parsed_in_bytes():
    assert mem_available_bytes(MEMINFO) == 1 << 30
    with pytest.raises(ValueError):
        mem_available_bytes("MemTotal: 5 kB\n")


def test_a_cgroup_limit_bounds_what_is_free(tmp_path):
    (tmp_path / "meminfo").write_text(MEMINFO)
    meminfo, cg = str(tmp_path / "meminfo"), tmp_path / "cg"
    assert read_mem_available(meminfo, str(cg)) == 1 << 30  # no cgroup files
    cg.mkdir()
    (cg / "memory.max").write_text("max\n")
    (cg / "memory.current").write_text(str(100 * MIB))
    assert read_mem_available(meminfo, str(cg)) == 1 << 30
    (cg / "memory.max").write_text(str(300 * MIB))
    assert read_mem_available(meminfo, str(cg)) == 200 * MIB
    assert read_mem_available(str(tmp_path / "none"), str(cg)) is None


def test_fraction_floor_and_batch_bound():
    # 1 GiB free, 1 MiB blocks, 0.5 → 512 blocks; floor of a 2048-token request = 128
    assert auto_num_blocks(1 << 30, MIB, 2048, 16) == 512
    assert auto_num_blocks(1 << 30, MIB, 2048, 16, fraction=0.25) == 256
    assert auto_num_blocks(1 << 30, MIB, 2048, 16, max_num_seqs=2) == 256  # 2 × 128
    assert auto_num_blocks(1 << 30, MIB, 2048, 16, max_num_seqs=64) == 512  # budget first
    # the floor wins over the fraction while it still fits in what is free
    assert auto_num_blocks(200 * MIB, MIB, 2048, 16) == 128
    assert floor_blocks(17, 16) == 2 and floor_blocks(1, 16) == 2
    assert auto_num_blocks(None, MIB, 2048, 16) == FALLBACK_BYTES // MIB


def test_no_room_for_one_request_names_numbers_and_flags():
    with pytest.raises(KVBudgetError) as e:
        auto_num_blocks(100 * MIB, MIB, 2048, 16)
    msg = str(e.value)
    assert "128 blocks" in msg and "100 MiB" in msg and "2048-token" in msg
    assert "--kv-cache-memory-bytes" in msg and "--num-blocks" in msg


def test_cluster_share_divides_what_the_weights_leave():
    assert cluster_share(10 * MIB, MIB, 2, fraction=0.5) == 2 * MIB  # (10 − 2) × 0.5 / 2
    with pytest.raises(KVBudgetError, match="3 workers"):
        cluster_share(2 * MIB, MIB, 3)


def test_engine_sizes_its_pool_from_free_memory(tiny_llama, monkeypatch):
    per_block = 2 * 2 * 16 * 2 * 16 * 4  # tiny Llama, block_size 16: 8 KiB
    monkeypatch.setattr("baton.engine.kv_budget.read_mem_available", lambda: 1000 * per_block)
    assert LLM(str(tiny_llama), kv_pool_for_batch=False, dtype="float32").engine.num_blocks == 500
    # offline: no more than max_num_seqs longest requests (1024 positions = 64 blocks)
    assert LLM(str(tiny_llama), max_num_seqs=4, dtype="float32").engine.num_blocks == 4 * 64
    explicit = LLM(str(tiny_llama), num_blocks=7, dtype="float32")
    assert explicit.engine.num_blocks == 7  # explicit wins
    monkeypatch.setattr("baton.engine.kv_budget.read_mem_available", lambda: 10 * per_block)
    with pytest.raises(KVBudgetError, match="1024-token request needs 64 blocks"):
        LLM(str(tiny_llama), dtype="float32")
    # a 64-token limit: floor 4 blocks, half of 10 free = 5
    assert LLM(str(tiny_llama), max_model_len=64, dtype="float32").engine.num_blocks == 5


def test_baton_up_splits_one_budget_over_its_workers(tiny_llama):
    # fp32 named: the byte counts below are fp32's (auto is bf16 on CPUs with AVX512_BF16)
    a = parse_up_args(["--model", str(tiny_llama), "--num-decode", "2", "--dtype", "float32"])
    weights = weight_bytes(tiny_llama, 4)
    config = json.loads((tiny_llama / "config.json").read_text())
    assert weights > 0 and block_bytes_of(config, 16, 4) == 2 * 2 * 16 * 2 * 16 * 4
    free = 3 * weights + 300 * MIB  # 1 prefill + 2 decode workers
    share = kv_bytes_per_worker(a, tiny_llama, free)
    assert share == int(300 * MIB * 0.5) // 3
    set_role_flag(a, "kv_cache_memory_bytes", share)
    assert decode_args(a)[decode_args(a).index("--kv-cache-memory-bytes") + 1] == str(share)
    explicit = parse_up_args(["--model", str(tiny_llama), "--num-blocks", "64", "--dtype",
                              "float32"])
    assert kv_bytes_per_worker(explicit, tiny_llama, free) is None
    with pytest.raises(KVBudgetError, match="--num-blocks"):
        kv_bytes_per_worker(a.__class__(**{**vars(a), "kv_cache_memory_bytes": None}),
                            tiny_llama, 3 * weights + 3 * 64 * 8192 - 1)


def test_a_worker_whose_pool_cannot_fit_exits_with_the_message(tiny_llama, monkeypatch, capsys):
    import asyncio

    from baton.config import EngineConfig
    from baton.worker.flags import RoleConfig
    from baton.worker.process import StartFailed
    from baton.worker.start import start_worker

    monkeypatch.setattr("baton.engine.kv_budget.read_mem_available", lambda: 100 << 10)
    config = RoleConfig(engine=EngineConfig(model=str(tiny_llama)))
    with pytest.raises(StartFailed):
        asyncio.run(start_worker("decode", "baton.v1.DecodeService", config,
                                 lambda rt: pytest.fail("built a worker without a pool")))
    err = capsys.readouterr().err
    assert err.startswith("decode worker: the KV pool does not fit") and "--num-blocks" in err


def test_a_cuda_pool_is_sized_from_its_device_not_host_memory(monkeypatch):
    import torch

    from baton.engine.kv_budget import free_for_pool

    seen = []
    monkeypatch.setattr(torch.cuda, "mem_get_info",
                        lambda device=None: seen.append(device) or (7 * MIB, 80 * MIB))
    monkeypatch.setattr("baton.engine.kv_budget.read_mem_available", lambda: MIB)
    # the host tier lives in host memory: not taken off the device's free bytes
    cuda = torch.device("cuda", 1)
    assert free_for_pool(cuda, host_tier_bytes=5 * MIB) == (7 * MIB, "free on cuda:1")
    assert seen == [cuda]
    assert free_for_pool(torch.device("cpu"), host_tier_bytes=MIB // 2) == (MIB // 2,
                                                                           "MemAvailable")
    with pytest.raises(KVBudgetError, match=r"free on cuda:1"):
        auto_num_blocks(7 * MIB, MIB, 2048, 16, source="free on cuda:1")
