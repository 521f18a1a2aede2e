"""What the decode worker holds of a prompt and this prefill worker lacks is read, not
recomputed: the Prefill call names the decode worker's blocks of its prefix hit
(PrefillRequest.src_block_ids), the engine allocates the request's blocks and waits
(BlockHolds.add_pulling), and this reads the missing ones from the decode worker's kv_cache
over the transfer endpoint (a NIXL READ, or KVTransfer.PullBlocks on gRPC) before the
prompt is computed from there.

    decode holds 3 blocks, prefill's own hit is 1:
    decode kv_cache   [ 7 ][ 8 ][ 9 ]          src_block_ids = [7, 8, 9]
                            │    │  READ / PullBlocks
    prefill blocks    [ 2 ][ 5 ][ 6 ][ ... computed ... ]   PrefixPull(first_block=1,
                                                             dst_block_ids=[5, 6])

Safety: the decode worker keeps its src blocks unchanged until the Prefill call (or an Abort)
is answered; so a pull is always final before either answer leaves: on abort or timeout it
is cancelled and waited out here before PrefillEnded propagates (the request's blocks are
freed only after that), and its blocks are cached only once every byte landed (`pulled`).
A pull that fails (transport error, a refused read) is computed instead: never wrong KV.
"""
from __future__ import annotations

import logging
import time

from baton.engine.block_holds import PrefixPull
from baton.transfer import KVLayoutError, KVSender, TransferState, pull_id
from prefill_service.sequence import PrefillEnded, PrefillSequence
from protos import prefill_pb2

log = logging.getLogger(__name__)
_FINAL_WAIT_S = 5.0  # after a cancel, or past the deadline: the transport's own bound


async def pull_prefix(sender: KVSender, seq: PrefillSequence, pull: PrefixPull) -> bool:
    """Read the decode worker's blocks for `pull` into its dst blocks. True once every byte
    landed (seq.pulled_* count them); False when the pull failed (compute them instead).
    Raises PrefillEnded on abort or deadline, only once no byte can still be moving."""
    req, rid = seq.request, seq.request_id
    src = list(req.src_block_ids)[pull.first_block:pull.first_block + len(pull.dst_block_ids)]
    pid, budget = pull_id(req.transfer_id), max(0.001, seq.deadline - time.monotonic())
    try:
        sender.pull(req.endpoint, req.transfer_id, src, pull.dst_block_ids, request_id=rid,
                    timeout_s=budget)
    except (KVLayoutError, ValueError, RuntimeError, NotImplementedError) as e:
        log.warning("KV pull refused, computing instead: %s", e, extra={"request_id": rid})
        return False
    try:
        state = await seq.until(sender.wait_async(pid, budget + 1.0))
        if not state.finished:
            state = await _final(sender, pid)
    except PrefillEnded:
        await _final(sender, pid)
        raise
    finally:
        sender.forget(pid)
    if state != TransferState.DONE:
        log.warning("KV pull ended %s, computing instead", state.name, extra={"request_id": rid})
        return False
    seq.pulled_blocks = len(src)
    seq.pulled_tokens = len(src) * (req.num_cached_on_decode // len(req.src_block_ids))
    return True


async def _final(sender: KVSender, pid: str) -> TransferState:
    """Cancel the pull and wait for its final state (no READ moves after it)."""
    sender.cancel(pid)
    state = await sender.wait_async(pid, _FINAL_WAIT_S)
    if not state.finished:  # the transport broke its own bound: say so, loudly
        log.error("KV pull %s not final %.0f s after its cancel", pid, _FINAL_WAIT_S)
        raise PrefillEnded(prefill_pb2.PREFILL_STATUS_TRANSFER_FAILED, "KV pull did not stop")
    return state
