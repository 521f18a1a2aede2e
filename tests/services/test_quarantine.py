"""Issue 15 item 1: a hold on decode blocks (NIXL: a late write may land) ends as soon as the
prefill worker answers a re-sent Abort, not at the prefill deadline (prefill_max_seconds)."""
from __future__ import annotations

import asyncio
import dataclasses
import threading
import time

import pytest

from decode_service import quarantine
from decode_service.config import DecodeConfig
from decode_service.context import DecodeContext
from decode_service.metrics import DecodeMetrics
from decode_service.peers import AbortAnswer, PrefillPeer
from decode_service.quarantine import Quarantine
from prefill_service.sequence import PrefillState
from protos import common_pb2
from tests.reference import hf_greedy
from tests.services.helpers import FORCE_REMOTE, engine_config, pools_whole, request
from tests.services.test_aborts import prefill_state, wait_for
from tests.services.test_failures import _slow_steps, prompt_of, sample


async def test_unconfirmed_abort_hold_ends_once_prefill_answers(cluster, model):
    """Decode's Abort times out while the prefill engine is in a long step: the destination
    blocks are held (NIXL). Once the step ends, a re-sent Abort is answered and the hold
    ends within seconds, not at the 600 s deadline; a request needing every block runs."""
    gate = threading.Event()
    prefill = await cluster.prefill(model, "nixl")
    decode = await cluster.decode(model, "nixl", prefill.address,
                                  engine=engine_config(model, num_blocks=12),
                                  abort_timeout_seconds=0.3, prefill_max_seconds=600,
                                  quarantine_grace_seconds=5, **FORCE_REMOTE)
    client = cluster.client(decode)
    _slow_steps(prefill, 0.0, gate)  # every prefill step waits: one long step
    try:
        call = client.decode.Generate(request(prompt_of(40, 21), rid="held"), timeout=60)
        await wait_for(lambda: prefill_state(prefill, "held") == PrefillState.PREFILLING)
        assert (await client.decode.Abort(common_pb2.AbortRequest(request_id="held"))).found
        await wait_for(lambda: sample(decode, "baton_decode_quarantined_requests") == 1)
        assert decode.remote_kv.num_held_blocks == 5  # 40 tokens / 8 per block
        msgs = [m async for m in call]
        assert msgs[-1].finished.finish_reason == common_pb2.FINISH_REASON_ABORT
    finally:
        gate.set()  # the long step ends; the prefill worker can answer Abort now
    await pools_whole(prefill, decode, timeout=15)  # seconds, not prefill_max_seconds
    assert decode.remote_kv.num_held_blocks == 0
    assert sample(decode, "baton_decode_quarantined_requests") == 0
    assert sample(decode, "baton_decode_quarantines_total") == 1
    assert sample(decode, "baton_decode_quarantines_confirmed_total") == 1
    big = prompt_of(84, 22)  # 84 + 8 tokens: all 12 blocks, the 5 held ones included
    res = await client.generate(big, timeout=60)
    assert res.output == hf_greedy(model, big, 8)
    await pools_whole(prefill, decode)


# ---- the quarantine's own loop, with a scripted prefill worker ---------------------------
class ScriptedPeers:
    """PrefillPeers.abort answering from a script (its last answer repeats)."""

    def __init__(self, *answers: AbortAnswer) -> None:
        self.answers, self.calls = list(answers), 0

    async def abort(self, peer, request_id, again=False):
        assert again
        self.calls += 1
        return self.answers[min(self.calls, len(self.answers)) - 1]


class HoldingEngine:
    """AsyncEngine.call + RemoteKV.release_hold in one: records when the hold is released."""

    def __init__(self) -> None:
        self.released: list[tuple[int, float]] = []

    async def call(self, fn):
        return fn(None)

    def release_hold(self, hold_id: int) -> bool:
        self.released.append((hold_id, time.monotonic()))
        return True


async def run_quarantine(monkeypatch, peers: ScriptedPeers, seconds: float):
    monkeypatch.setattr(quarantine, "RETRY_FIRST_S", 0.01)
    monkeypatch.setattr(quarantine, "RETRY_MAX_S", 0.02)
    metrics = DecodeMetrics()
    ctx = DecodeContext(DecodeConfig(), None, peers, metrics, asyncio.create_task, None)
    engine = HoldingEngine()
    q = Quarantine(7, "r", PrefillPeer("p:1", None, "p", 5), time.monotonic() + seconds)
    await asyncio.wait_for(q.run(engine, engine, ctx), seconds + 10)
    value = metrics.registry.get_sample_value
    assert value("baton_decode_quarantined_requests") == 0
    return q, engine, value("baton_decode_quarantines_confirmed_total")


async def test_quarantine_ends_at_the_first_answer_of_the_same_process(monkeypatch):
    peers = ScriptedPeers(AbortAnswer.UNANSWERED, AbortAnswer.UNANSWERED, AbortAnswer.STOPPED)
    q, engine, confirmed = await run_quarantine(monkeypatch, peers, 600)
    assert peers.calls == 3 and confirmed == 1
    assert [h for h, _ in engine.released] == [7] and engine.released[0][1] < q.until


@pytest.mark.parametrize("answer", [AbortAnswer.OTHER_PROCESS, AbortAnswer.UNANSWERED])
async def test_quarantine_without_that_answer_lasts_until_the_deadline(monkeypatch, answer):
    """A restarted process cannot vouch for the old one (asked once); silence is asked
    again and again; either way the blocks come back at `until`, not before."""
    peers = ScriptedPeers(answer)
    q, engine, confirmed = await run_quarantine(monkeypatch, peers, 0.3)
    assert confirmed == 0 and [h for h, _ in engine.released] == [7]
    assert engine.released[0][1] >= q.until
    assert peers.calls == 1 if answer is AbortAnswer.OTHER_PROCESS else peers.calls > 1


# ---- kv_epoch: only the process that shook hands writes, and only its answers count ------
async def test_prefill_refuses_another_process_handshake_and_names_itself(cluster, model):
    """A prefill worker that restarted since the handshake (simulated: the decode worker's
    cached peer carries another kv_epoch) does no work for it (STALE_HANDSHAKE); the decode
    worker shakes hands again at once and sends the Prefill once more, to the live process:
    the request is prefilled remotely, once. Abort answers say which process answered."""
    prefill = await cluster.prefill(model, "nixl")
    decode = await cluster.decode(model, "nixl", prefill.address, **FORCE_REMOTE)
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
    assert res.output == hf_greedy(model, prompt, 8) and res.fin.timings.remote_prefill
    assert sample(prefill, "baton_prefill_computed_tokens_total") == 40  # computed once
    assert sample(decode, "baton_decode_remote_prefills_total", outcome="ok") == 1
    assert (await decode.peers.get(prefill.address)).kv_epoch == epoch
    await pools_whole(prefill, decode)
