"""The KV store tier's writer without a store (an in-memory stand-in for MooncakeClient):
a full staging queue drops blocks and counts them instead of waiting, a full store refusing
puts costs only those blocks, publishing copies the KV out so the pool may reuse the block at
once, blocks the store already has are not put again, and a store that is down takes
nothing and loads nothing."""
import threading

import torch

from baton.engine.block_pool import Block
from baton.engine.kv_store import StoreTier

BS = 4


class FakeClient:
    """MooncakeClient's interface over a dict; `gate` holds the writer inside exists_many."""

    def __init__(self) -> None:
        self.values: dict[str, bytes] = {}
        self.gate = threading.Event()
        self.gate.set()
        self.connected = True
        self.unavailable = 0
        self.epoch, self.reconnects = 1, 0  # the connection's generation (store_client.py)
        self.retry_s = 1.0
        self.segment_bytes = 0
        self.puts = 0
        self.refuse = False  # answer puts as a full store does (connection fine)

    def check(self) -> None:
        pass

    def exists_many(self, keys):
        self.gate.wait(30)
        if not self.connected:
            self.unavailable += 1
            return None
        return [k in self.values for k in keys]

    def put(self, key, *parts) -> bool:
        self.puts += 1
        if self.refuse:
            return False
        self.values[key] = b"".join(bytes(p) for p in parts)
        return True

    def get(self, key):
        if not self.connected:
            self.unavailable += 1
            return None
        return self.values.get(key)

    def remove(self, key) -> None:
        self.values.pop(key, None)

    def close(self) -> None:
        pass


def _tier(slots: int):
    kv = torch.randn(8, 2, 2, BS, 2, 8)  # [num_blocks, layers, K/V, block_size, heads, dim]
    client = FakeClient()
    return StoreTier(kv, client, 7, queue_bytes=slots * kv[0].numel() * 4), client


def _block(i: int) -> Block:
    return Block(i, 1, block_hash=1000 + i, token_ids=tuple(range(i, i + BS)))


def test_a_full_queue_drops_and_counts_instead_of_waiting():
    tier, client = _tier(slots=2)
    client.gate.clear()  # the writer takes the first block and waits inside the store call
    tier.publish([_block(0), _block(1), _block(2), _block(3)])
    assert tier.queue_full_drops == 2 and tier.totals.dropped_blocks == 2
    want = tier.kv_cache[0].clone()
    tier.kv_cache[0].zero_()  # the pool reuses block 0 meanwhile: the queued copy is kept
    client.gate.set()
    assert tier.flush(30)
    assert tier.totals.saved_blocks == 2 and client.puts == 2
    other, _ = _tier(slots=1)
    other.client = client
    claim = other.claim(1000, tuple(range(BS)))
    assert claim is not None
    other.finish(claim, 5)
    assert torch.equal(other.kv_cache[5], want)
    tier.close()
    other.close()


def test_blocks_the_store_has_are_not_put_again():
    tier, client = _tier(slots=4)
    tier.publish([_block(0), _block(1)])
    assert tier.flush(30) and client.puts == 2
    tier._known.clear()  # another worker's view: it does not know they are there
    tier.publish([_block(0), _block(1), _block(2)])
    assert tier.flush(30) and client.puts == 3  # only block 2
    tier.close()


def test_a_new_connection_epoch_publishes_known_blocks_again():
    """A master that restarted lost every value: after the client's new epoch, blocks the
    tier believed stored are not "known" any more, so publishing them writes them again."""
    tier, client = _tier(slots=4)
    tier.publish([_block(0), _block(1)])
    assert tier.flush(30) and client.puts == 2 and tier.contains(1000)
    tier.publish([_block(0)])
    assert tier.flush(30) and client.puts == 2  # known: not even queued
    client.values.clear()  # the master restarted...
    client.epoch, client.reconnects = 2, 1  # ...and the client reconnected
    assert not tier.contains(1000)
    tier.publish([_block(0), _block(1)])
    assert tier.flush(30) and client.puts == 4
    assert tier.counts().totals.reconnects == 1
    tier.close()


def test_a_store_that_is_down_takes_and_gives_nothing():
    tier, client = _tier(slots=4)
    client.connected = False
    tier.publish([_block(0)])
    assert tier.flush(30) and client.puts == 0 and not client.values
    assert tier.claim(1000, tuple(range(BS))) is None
    assert tier.counts().totals.unavailable >= 1
    tier.close()


def test_a_full_store_refusing_puts_drops_those_blocks_and_keeps_writing():
    tier, client = _tier(slots=4)
    client.refuse = True
    tier.publish([_block(0), _block(1)])
    assert tier.flush(30) and tier.totals.dropped_blocks == 2 and not client.values
    client.refuse = False
    tier.publish([_block(0), _block(2)])  # refused ones were forgotten: tried again
    assert tier.flush(30) and tier.totals.saved_blocks == 2 and len(client.values) == 2
    tier.close()
