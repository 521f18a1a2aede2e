"""KVStreams on two engines, no RPC (prefill_service/kv_stream.py): pushed blocks stay pinned
through a preemption and an abort of their prompt, and the streamed KV decodes exactly."""
import random

import pytest

from baton import LLM, SamplingParams
from baton.engine.block_holds import BlockHolds
from baton.engine.remote_kv import RemoteKV
from baton.transfer import TransferState, kv_layout
from baton.transfer.inproc import InprocReceiver, InprocSender
from prefill_service.kv_stream import KVStream, KVStreams
from tests.reference import hf_greedy

BS = 8
PARAMS = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
ONE = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)


@pytest.fixture
def pair(tiny_llama):
    """(prefill engine, holds, streams, sender), (decode engine, RemoteKV, receiver)."""
    prefill = LLM(str(tiny_llama), block_size=BS, num_blocks=64,
                  long_prefill_token_threshold=BS, dtype="float32").engine  # one block per step
    decode = LLM(str(tiny_llama), block_size=BS, num_blocks=64, dtype="float32").engine
    sender = InprocSender(prefill.kv_cache, kv_layout("m", prefill.kv_cache))
    receiver = InprocReceiver(decode.kv_cache, kv_layout("m", decode.kv_cache))
    holds = BlockHolds(prefill)
    yield (prefill, holds, KVStreams(holds, sender, BS), sender), \
        (decode, RemoteKV(decode), receiver)
    receiver.close()


def _open(p, d, rid, prompt):
    (prefill, holds, streams, sender), (decode, rkv, receiver) = p, d
    plan, _, _ = rkv.add(rid, prompt, PARAMS, min_remote_tokens=1)
    receiver.expect(rid, plan.dst_block_ids)
    stream = KVStream(rid, rid, plan.num_cached_tokens // BS, list(plan.dst_block_ids))
    assert streams.open(stream, receiver.endpoint(), timeout_s=30)
    holds.add(rid, prompt, ONE)
    return stream


def _step(prefill, streams):
    outs = prefill.step()
    streams.after_step(prefill)
    return outs


def test_pins_survive_a_preemption_and_the_stream_decodes_exactly(pair, tiny_llama):
    p, d = pair
    (prefill, holds, streams, sender), (decode, rkv, receiver) = p, d
    prompt = [random.Random(1).randrange(3, 380) for _ in range(37)]  # 5 blocks, 5 steps
    stream = _open(p, d, "r", prompt)
    _step(prefill, streams)
    _step(prefill, streams)
    assert stream.pushes == [1, 1] and len(stream.pinned) == 2
    pinned = {b.block_id for b in stream.pinned}
    req = prefill.get_request("r")
    prefill.scheduler.running.remove(req)  # what _allocate_or_preempt does to a victim
    prefill.scheduler._preempt(req)
    assert all(prefill.kv.pool.blocks[b].ref_cnt == 1 for b in pinned)  # the pins' refs
    assert prefill.kv.num_free_blocks == prefill.kv.num_blocks - 2
    first = []
    for _ in range(20):
        first += [o.new_token_ids[0] for o in _step(prefill, streams) if o.request_id == "r"]
        if first:
            break
    # blocks 0 and 1 come back as prefix hits (pinned, still cached) and are not sent
    # again; 2 and 3 go out as their steps end, 4 in the after_step of the first token's
    # step (the prompt is held: the stream finishes at once, the worker need not ask)
    assert stream.pushes == [1, 1, 1, 1, 1] and stream.ended
    streams.finish(stream)  # idempotent: nothing more is pushed
    assert sum(stream.pushes) == 5 and receiver.poll("r") == TransferState.DONE
    streams.unpin(stream)
    assert holds.release("r")
    assert prefill.kv.num_free_blocks == prefill.kv.num_blocks
    out = rkv.finish("r", first[0])
    tokens = out.new_token_ids
    while len(tokens) < 8:
        tokens += [t for o in decode.step() if o.request_id == "r" for t in o.new_token_ids]
    assert tokens == hf_greedy(tiny_llama, prompt, 8)


def test_abort_mid_stream_keeps_pushed_blocks_until_unpinned(pair):
    p, d = pair
    (prefill, holds, streams, sender), (decode, rkv, receiver) = p, d
    sender.auto_complete = False  # the pushed block stays in flight
    stream = _open(p, d, "a", list(range(3, 40)))
    _step(prefill, streams)
    pinned = list(stream.pinned)
    assert stream.pushes == [1] and sender.poll("a") == TransferState.IN_PROGRESS
    holds.abort("a")
    _step(prefill, streams)  # the request is gone: nothing more is pushed
    assert stream.pushes == [1]
    assert prefill.kv.num_free_blocks == prefill.kv.num_blocks - 1
    assert all(b.ref_cnt == 1 for b in pinned)
    streams.stop(stream)
    assert sender.poll("a") == TransferState.CANCELLED
    assert receiver.poll("a") == TransferState.FAILED
    streams.unpin(stream)
    assert prefill.kv.num_free_blocks == prefill.kv.num_blocks
