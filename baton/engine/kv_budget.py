"""How many KV blocks a pool gets when no one says (no --num-blocks, no
--kv-cache-memory-bytes): a fraction of the memory actually free, never less than one
longest request, and a clear error when even that does not fit.

    explicit num_blocks             → that many blocks
    explicit kv_cache_memory_bytes  → bytes // bytes_per_block (max_model_len capped to fit)
    neither (the default):
        free     = MemAvailable (/proc/meminfo; within a cgroup v2 memory limit, at most
                   limit − usage), read after the model is loaded,
                   less the host KV tier's bytes (allocated after the pool)
        floor    = ceil(max_model_len / block_size) blocks   (one longest request)
        budget   = kv_memory_fraction × free                  (default 0.5)
        blocks   = max(floor, budget // bytes_per_block)
        offline LLM: blocks = min(blocks, max(floor, max_num_seqs × floor))
        floor × bytes_per_block > free → KVBudgetError naming the numbers and the flags

The rest of free memory is headroom: activations, the tokenizer, a host KV tier, the page
cache and other processes. `baton up` starts several workers at once; each sizing itself
from the same free memory would count it several times over, so `cluster_share` divides
one budget among them (after every worker's copy of the weights) and passes each its bytes.
Without /proc/meminfo (not Linux) the fallback is FALLBACK_BYTES. On CUDA the pool lives in
device memory: `free` is the device's free memory (cudaMemGetInfo) after the model and, the
host tier being elsewhere, nothing is taken off it; `baton up` divides `kv_memory_fraction`
among the workers sharing one GPU (cluster/devices.py).
"""
from __future__ import annotations

import json
import struct
from pathlib import Path

KV_MEMORY_FRACTION = 0.5
FALLBACK_BYTES = 2 << 30
_MIB = 1 << 20
_DTYPE_BYTES = {"F64": 8, "F32": 4, "I64": 8, "I32": 4, "BF16": 2, "F16": 2, "I16": 2,
                "I8": 1, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}
FLAGS = "--kv-cache-memory-bytes or --num-blocks (or a smaller --max-model-len)"


class KVBudgetError(ValueError):
    """The minimum KV pool does not fit in the free memory."""


def mem_available_bytes(meminfo: str) -> int:
    """MemAvailable in bytes from the text of /proc/meminfo ("MemAvailable: 123 kB").
    Raises ValueError when the line is missing."""
    for line in meminfo.splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise ValueError("no MemAvailable line in meminfo")


def read_mem_available(path: str = "/proc/meminfo",
                       cgroup: str = "/sys/fs/cgroup") -> int | None:
    """Memory free to this process in bytes: MemAvailable, and inside a cgroup v2 memory
    limit (a container: /proc/meminfo shows the host's) no more than limit − usage; None
    where there is no /proc/meminfo."""
    try:
        free = mem_available_bytes(Path(path).read_text())
    except (OSError, ValueError):
        return None
    try:
        limit = Path(cgroup, "memory.max").read_text().strip()
        used = int(Path(cgroup, "memory.current").read_text())
    except (OSError, ValueError):
        return free
    return free if limit == "max" else max(0, min(free, int(limit) - used))


def free_for_pool(device, host_tier_bytes: int = 0) -> tuple[int | None, str]:
    """(bytes free for a KV pool on `device` now, what they are) after the model loaded: on
    CUDA the device's free memory (cudaMemGetInfo; the host tier lives elsewhere), else
    MemAvailable less the host tier about to be allocated (None without /proc/meminfo)."""
    if device.type == "cuda":
        import torch

        return torch.cuda.mem_get_info(device)[0], f"free on {device}"
    free = read_mem_available()
    return (None if free is None else max(0, free - host_tier_bytes)), "MemAvailable"


def floor_blocks(max_model_len: int, block_size: int) -> int:
    """Blocks one request of max_model_len tokens needs (at least 2, as CacheConfig asks)."""
    return max(2, -(-max_model_len // block_size))


def auto_num_blocks(free_bytes: int | None, bytes_per_block: int, max_model_len: int,
                    block_size: int, fraction: float = KV_MEMORY_FRACTION,
                    max_num_seqs: int | None = None, source: str = "MemAvailable") -> int:
    """The default pool of the module docstring, in blocks.

    free_bytes: MemAvailable after the model is loaded (None: FALLBACK_BYTES is the budget;
    on CUDA the device's free memory, `source` naming it in the error).
    max_num_seqs: given (offline LLM), no more than that many longest requests' worth.
    Raises KVBudgetError when one max_model_len request does not fit in free_bytes.
    """
    floor = floor_blocks(max_model_len, block_size)
    if free_bytes is None:
        blocks = FALLBACK_BYTES // bytes_per_block
    else:
        if floor * bytes_per_block > free_bytes:
            raise KVBudgetError(
                f"the KV pool does not fit: one {max_model_len}-token request needs {floor} "
                f"blocks × {bytes_per_block} B = {floor * bytes_per_block / _MIB:.0f} MiB, "
                f"but only {free_bytes / _MIB:.0f} MiB is free ({source}) after loading "
                f"the model; set {FLAGS}")
        blocks = int(free_bytes * fraction) // bytes_per_block
    blocks = max(floor, blocks)
    if max_num_seqs is not None:
        blocks = min(blocks, max(floor, max_num_seqs * floor))
    return blocks


def weight_bytes(folder: Path, element_size: int | None = None) -> int:
    """Bytes the model's weights take once loaded: every tensor of its *.safetensors files
    (from their headers; nothing else is read), at `element_size` bytes per value (the load
    dtype; None: as stored). Raises ValueError for a malformed header."""
    total = 0
    for f in sorted(Path(folder).glob("*.safetensors")):
        with open(f, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(n))
        for name, t in header.items():
            if name == "__metadata__":
                continue
            numel = 1
            for d in t["shape"]:
                numel *= d
            total += numel * (element_size or _DTYPE_BYTES[t["dtype"]])
    return total


def cluster_share(free_bytes: int, model_bytes: int, num_workers: int,
                  fraction: float = KV_MEMORY_FRACTION) -> int:
    """KV bytes per worker of a local cluster: `fraction` of what is free once every worker
    has loaded its copy of the weights, divided evenly. Raises KVBudgetError when the
    weights alone do not fit."""
    left = free_bytes - num_workers * model_bytes
    if left <= 0:
        raise KVBudgetError(
            f"{num_workers} workers × {model_bytes / _MIB:.0f} MiB of weights exceed the "
            f"{free_bytes / _MIB:.0f} MiB free (MemAvailable); start fewer workers or set {FLAGS}")
    return int(left * fraction) // num_workers


def block_bytes_of(config: dict, block_size: int, element_size: int) -> int:
    """Bytes of one KV block of a model's config.json (as ModelRunner.bytes_per_block):
    layers × 2 (K, V) × block_size × kv heads × head size × element size."""
    heads = config["num_attention_heads"]
    head = config.get("head_dim") or config["hidden_size"] // heads
    kv_heads = config.get("num_key_value_heads") or heads
    return config["num_hidden_layers"] * 2 * block_size * kv_heads * head * element_size


def cluster_kv_bytes(folder: Path, free_bytes: int, num_workers: int, block_size: int,
                     element_size: int, max_model_len: int | None,
                     fraction: float = KV_MEMORY_FRACTION) -> int:
    """`cluster_share` for the model in `folder` loaded at element_size bytes per value,
    checked against each worker's floor (one max_model_len request; default the model's
    max_position_embeddings): at least the floor, as a single worker's pool. Raises
    KVBudgetError naming the numbers and the flags."""
    config = json.loads((Path(folder) / "config.json").read_text())
    model = weight_bytes(folder, element_size)
    share = cluster_share(free_bytes, model, num_workers, fraction)
    per_block = block_bytes_of(config, block_size, element_size)
    limit = max_model_len or config["max_position_embeddings"]
    need = floor_blocks(limit, block_size) * per_block
    if need > (free_bytes - num_workers * model) // num_workers:
        raise KVBudgetError(
            f"the KV pools do not fit: one {limit}-token request needs {need / _MIB:.0f} MiB "
            f"per worker, but {free_bytes / _MIB:.0f} MiB free (MemAvailable) less "
            f"{num_workers} × {model / _MIB:.0f} MiB of weights leaves "
            f"{(free_bytes - num_workers * model) / num_workers / _MIB:.0f} MiB each; "
            f"set {FLAGS}")
    return max(share, need)
