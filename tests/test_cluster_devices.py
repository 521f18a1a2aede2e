"""`baton up --device`: which device each worker gets and its share of that device's memory
(baton/cluster/devices.py), and that a worker's command line with them parses to it."""
from __future__ import annotations

import pytest

from baton.cluster.devices import device_flags, device_plan
from baton.cluster.flags import parse_up_args
from baton.cluster.plan import decode_args, prefill_args
from decode_service.config import parse_args as decode_parse
from prefill_service.config import parse_args as prefill_parse

NAMES = ["prefill-0", "decode-0", "decode-1"]


@pytest.mark.parametrize("device, gpus, want", [
    ("cpu", 0, ["cpu", "cpu", "cpu"]),
    ("cuda", 1, ["cuda:0", "cuda:0", "cuda:0"]),
    ("cuda", 2, ["cuda:0", "cuda:1", "cuda:0"]),
    ("cuda", 4, ["cuda:0", "cuda:1", "cuda:2"]),
    ("cuda:1", 2, ["cuda:1", "cuda:1", "cuda:1"]),
])
def test_device_plan(device, gpus, want):
    assert device_plan(device, NAMES, gpus) == dict(zip(NAMES, want))


@pytest.mark.parametrize("device, gpus, match", [
    ("cuda", 0, "no CUDA device"), ("cuda:2", 2, "only 2 CUDA")])
def test_device_plan_refuses_missing_gpus(device, gpus, match):
    with pytest.raises(ValueError, match=match):
        device_plan(device, NAMES, gpus)


def test_cpu_workers_get_no_extra_flags():
    a = parse_up_args([])
    assert device_flags(a, NAMES, num_gpus=0) == {n: [] for n in NAMES}


def test_workers_sharing_a_gpu_split_its_kv_fraction():
    a = parse_up_args(["--device", "cuda", "--kv-memory-fraction", "0.6"])
    flags = device_flags(a, NAMES, num_gpus=2)  # cuda:0 holds prefill-0 and decode-1
    assert flags["prefill-0"] == ["--device", "cuda:0", "--kv-memory-fraction", "0.3"]
    assert flags["decode-0"] == ["--device", "cuda:1", "--kv-memory-fraction", "0.6"]
    assert flags["decode-1"] == flags["prefill-0"]


def test_a_pool_given_in_bytes_is_not_resized():
    a = parse_up_args(["--device", "cuda", "--kv-cache-memory-bytes", "1048576"])
    assert device_flags(a, NAMES, num_gpus=1)["decode-0"] == ["--device", "cuda:0"]


def test_placed_worker_argv_parses_to_its_device():
    a = parse_up_args(["--device", "cuda", "--enforce-eager"])
    flags = device_flags(a, ["prefill-0", "decode-0"], num_gpus=2)
    prefill = prefill_parse(prefill_args(a) + flags["prefill-0"]).engine
    decode = decode_parse(decode_args(a) + flags["decode-0"]).engine
    assert (prefill.device, decode.device) == ("cuda:0", "cuda:1")
    assert prefill.enforce_eager and decode.enforce_eager
    assert decode.cache.kv_memory_fraction == 0.5
