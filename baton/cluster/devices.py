"""Which device each worker of `baton up` computes on, and its share of that device's memory.

    --device cpu       every worker on the CPU: nothing to plan (the KV budget is host memory,
                       divided by `baton up` itself: plan.kv_bytes_per_worker)
    --device cuda:N    every worker on GPU N
    --device cuda      the workers dealt over the visible GPUs in turn (prefill workers first,
                       then decode: with 2 GPUs, 1 prefill + 1 decode get one GPU each)

A CUDA worker sizes its KV pool from its GPU's free memory when it starts (kv_budget.py), so
workers that start together on one GPU would each count the same free memory: each gets
`baton up --kv-memory-fraction` divided by the number of workers on its GPU (unless the pool
is given in bytes or blocks; host memory then sizes only the host KV tiers). Only `gpu_count`
imports torch, and only when asked.
"""
from __future__ import annotations

import argparse
from collections import Counter


def gpu_count() -> int:
    """CUDA devices visible to this process (0 without CUDA or without a CUDA build)."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def device_plan(device: str, names: list[str], num_gpus: int) -> dict[str, str]:
    """Worker name -> its --device value. ValueError when `device` names CUDA and there is
    no such GPU (`num_gpus` visible)."""
    kind, _, index = device.partition(":")
    if kind != "cuda":
        return {n: device for n in names}
    if num_gpus < 1:
        raise ValueError(f"--device {device}: no CUDA device is visible")
    if index:
        if int(index) >= num_gpus:
            raise ValueError(f"--device {device}: only {num_gpus} CUDA device(s) visible")
        return {n: device for n in names}
    return {n: f"cuda:{i % num_gpus}" for i, n in enumerate(names)}


def device_flags(a: argparse.Namespace, names: list[str],
                 num_gpus: int | None = None) -> dict[str, list[str]]:
    """Worker name -> the flags placing it (`--device`, and on a shared GPU its
    `--kv-memory-fraction` share). Nothing for CPU workers: their flags are the given ones.
    num_gpus: None counts them (imports torch). ValueError as `device_plan`."""
    device = a.device or "cpu"
    if not device.startswith("cuda"):
        return {n: [] for n in names}
    plan = device_plan(device, names, gpu_count() if num_gpus is None else num_gpus)
    sharers = Counter(plan.values())
    sized = a.num_blocks is not None or a.kv_cache_memory_bytes is not None
    out = {}
    for n, dev in plan.items():
        flags = ["--device", dev]
        if not sized:  # the workers size their pools from their GPU (baton up's own flag)
            flags += ["--kv-memory-fraction", f"{a.kv_memory_fraction / sharers[dev]:.6g}"]
        out[n] = flags
    return out
