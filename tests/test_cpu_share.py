"""Workers lending each other idle cores (baton/worker/cpu_share.py, `baton up --pin share`)."""
import asyncio
import threading

import pytest
import torch

from baton import LLM, SamplingParams
from baton.cluster.plan import cpu_plan, cpu_share_plan, decode_args
from baton.cluster.flags import parse_up_args
from baton.worker.async_engine import AsyncEngine
from baton.worker.cpu_share import CpuShare, create_share_file
from baton.worker.flags import ServerConfig
from decode_service.config import parse_args as decode_parse


def test_a_worker_alone_takes_every_core_and_busy_ones_split_them(tmp_path):
    path = create_share_file(tmp_path / "share", 3)
    a, b, c = (CpuShare(path, i, cpus=4) for i in range(3))
    assert a.threads_for_step() == 4  # the others idle
    assert b.threads_for_step() == 2 and a.threads_for_step() == 2
    assert c.threads_for_step() == 1  # 4 // 3
    b.idle()
    c.idle()
    assert a.threads_for_step() == 4
    a.close()
    assert path.read_bytes() == bytes(3)


def test_apply_sets_the_calling_threads_torch_threads(tmp_path):
    """torch's count is per thread: set on the (engine) thread that steps."""
    path = create_share_file(tmp_path / "share", 2)
    seen = []

    def engine_thread():
        a = CpuShare(path, 0, cpus=2)
        seen.append((a.apply(), torch.get_num_threads()))
        other = CpuShare(path, 1, cpus=2)
        other.threads_for_step()
        seen.append((a.apply(), torch.get_num_threads()))

    t = threading.Thread(target=engine_thread)
    t.start()
    t.join()
    assert seen == [(2, 2), (1, 1)]


def test_a_restarted_worker_clears_its_stale_busy_mark(tmp_path):
    path = create_share_file(tmp_path / "share", 2)
    CpuShare(path, 1, cpus=2).threads_for_step()  # dies busy
    a = CpuShare(path, 0, cpus=2)
    assert a.threads_for_step() == 1
    CpuShare(path, 1, cpus=2)  # its restart: idle until it has work
    assert a.threads_for_step() == 2


def test_bad_slots_and_flags_are_refused(tmp_path):
    path = create_share_file(tmp_path / "share", 2)
    with pytest.raises(ValueError, match="slot 2"):
        CpuShare(path, 2)
    with pytest.raises(ValueError):
        create_share_file(tmp_path / "none", 0)
    with pytest.raises(ValueError, match="FILE:SLOT"):
        ServerConfig(cpu_share="no-slot")


def test_baton_up_pin_share_gives_each_worker_a_slot_and_no_affinity(tmp_path):
    a = parse_up_args(["--pin", "share", "--num-prefill", "1", "--num-decode", "2"])
    cpus = cpu_plan(a.pin, a.mode, a.num_prefill, a.num_decode, cpus=[0, 1])
    assert set(cpus.values()) == {None}
    share = cpu_share_plan(a.pin, tmp_path, list(cpus))
    assert (tmp_path / "cpu-share").read_bytes() == bytes(3)
    assert sorted(flags[1].rpartition(":")[2] for flags in share.values()) == ["0", "1", "2"]
    config = decode_parse(decode_args(a) + share["decode-1"])
    assert config.server.cpu_share == f"{tmp_path / 'cpu-share'}:2"
    assert cpu_share_plan("split", tmp_path, list(cpus)) == {n: [] for n in cpus}


async def test_the_engine_thread_is_busy_while_stepping_and_idle_after(tiny_llama, tmp_path):
    path = create_share_file(tmp_path / "share", 2)
    engine = LLM(str(tiny_llama), block_size=8, num_blocks=64, dtype="float32").engine
    ae = AsyncEngine(engine)
    ae.cpu_share = CpuShare(path, 1, cpus=2)
    during = []
    ae.after_step = lambda _engine: during.append(path.read_bytes())
    ae.start()
    try:
        params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
        out = [t async for o in ae.generate("r", [3, 4, 5], params) for t in o.new_token_ids]
        assert len(out) == 4
        for _ in range(100):  # the engine thread marks itself idle once nothing is left
            if path.read_bytes() == bytes(2):
                break
            await asyncio.sleep(0.01)
    finally:
        ae.shutdown()
    assert during and all(b == b"\x00\x01" for b in during)
    assert path.read_bytes() == bytes(2)


async def test_a_step_follows_the_other_worker_between_layers(tiny_llama, tmp_path):
    """The other worker starts stepping while this one is inside a forward (a long prefill
    step): from the next layer on this step runs on one thread, not two beside its one."""
    path = create_share_file(tmp_path / "share", 2)
    engine = LLM(str(tiny_llama), block_size=8, num_blocks=64, dtype="float32").engine
    assert len(engine.runner.model.layers) >= 2
    ae = AsyncEngine(engine)
    ae.cpu_share = CpuShare(path, 0, cpus=2)
    other = CpuShare(path, 1, cpus=2)
    ae.start()
    share_hook = engine.runner.model.layer_hook
    seen = []

    def layer_hook():
        before = torch.get_num_threads()
        other.threads_for_step()  # the decode worker got work mid-step
        share_hook()
        seen.append((before, torch.get_num_threads()))

    engine.runner.model.layer_hook = layer_hook
    try:
        params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
        out = [t async for o in ae.generate("r", list(range(3, 40)), params)
               for t in o.new_token_ids]
    finally:
        ae.shutdown()
        other.close()
    assert len(out) == 1
    assert seen[0] == (2, 1)  # the step started alone, on both cores
    assert all(after == 1 for _, after in seen)


def test_the_share_another_worker_takes_prices_remote_prefill(tmp_path):
    """What a busy peer takes of this worker's cores (the P/D cost model's
    remote_stall_fraction): half of an even count, none with no peer in the file."""
    two = create_share_file(tmp_path / "two", 2)
    assert CpuShare(two, 0, cpus=2).shared_fraction() == 0.5
    assert CpuShare(two, 1, cpus=3).shared_fraction() == pytest.approx(2 / 3)
    alone = create_share_file(tmp_path / "alone", 1)
    assert CpuShare(alone, 0, cpus=2).shared_fraction() == 0.0
