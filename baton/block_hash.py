"""Chained block hashes: the identity of a full KV block is its tokens *and* everything before.

    hash(block_i) = H(hash(block_{i-1}) ‖ token_ids of block_i)      (block_{-1} hash = 0)

H is BLAKE2b with an 8-byte digest over little-endian int64 parent hash and int32 token ids,
so the value is the same in every process and on every machine (the gateway, prefill and
decode workers all compute it; Python's `hash()` is salted per process and cannot be used).
Only full blocks are hashed (as in vLLM and nano-vllm).
"""
from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence

import numpy as np

BlockHashFn = Callable[[int, Sequence[int]], int]


def hash_block(parent_hash: int, token_ids: Sequence[int]) -> int:
    """64-bit hash of one full block chained on its parent's hash (0 for the first block)."""
    h = hashlib.blake2b(digest_size=8)
    h.update(int(parent_hash).to_bytes(8, "little", signed=False))
    h.update(np.asarray(token_ids, dtype=np.int32).tobytes())
    return int.from_bytes(h.digest(), "little")


def hash_block_tokens(
    token_ids: Sequence[int],
    block_size: int,
    start_hashes: Sequence[int] = (),
    hash_fn: BlockHashFn = hash_block,
) -> list[int]:
    """Hashes of every full block of `token_ids`, continuing from `start_hashes`.

    `start_hashes` are hashes already computed for the leading blocks (they are kept and the
    chain continues after them). Returns a new list of len(token_ids) // block_size hashes.
    """
    hashes = list(start_hashes)
    parent = hashes[-1] if hashes else 0
    for i in range(len(hashes), len(token_ids) // block_size):
        parent = hash_fn(parent, token_ids[i * block_size:(i + 1) * block_size])
        hashes.append(parent)
    return hashes
