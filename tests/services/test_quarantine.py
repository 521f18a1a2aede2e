"""kv_epoch: a prefill worker works only for the process that shook hands with the decode
worker, and says which process answered an Abort (issue 15 item 1)."""
from __future__ import annotations

import dataclasses

from decode_service.peers import AbortAnswer
from tests.reference import hf_greedy
from tests.services.helpers import pools_whole
from tests.services.test_failures import prompt_of, sample


# ---- kv_epoch: only the process that shook hands writes, and only its answers count ------
async def test_prefill_refuses_another_process_handshake_and_names_itself(cluster, model):
    """A prefill worker that restarted since the handshake (simulated: the decode worker's
    cached peer carries another kv_epoch) does no work for it: the prompt is recomputed, the
    peer re-handshaken for the next request; Abort answers say which process answered."""
    prefill = await cluster.prefill(model, "nixl")
    decode = await cluster.decode(model, "nixl", prefill.address)
    client = cluster.client(decode, prefill)
    epoch = (await client.stats(client.prefill)).kv_epoch
    peer = await decode.peers.get(prefill.address)
    assert peer.kv_epoch == epoch != 0
    assert await decode.peers.abort(peer, "nobody") is AbortAnswer.STOPPED
    stale = dataclasses.replace(peer, kv_epoch=epoch ^ 1)
    assert await decode.peers.abort(stale, "nobody") is AbortAnswer.OTHER_PROCESS
    decode.peers._peers[prefill.address] = stale
    prompt = prompt_of(40, 23)
    res = await client.generate(prompt)
    assert res.output == hf_greedy(model, prompt, 8) and not res.fin.timings.remote_prefill
    assert sample(prefill, "baton_prefill_computed_tokens_total") == 0  # it did nothing
    res = await client.generate(prompt_of(40, 24))
    assert res.fin.timings.remote_prefill  # handshaken again with the live process
    assert (await decode.peers.get(prefill.address)).kv_epoch == epoch
    await pools_whole(prefill, decode)
