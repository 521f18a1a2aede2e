"""Issue 27, restarts are first-class (decode side): a prefill worker that restarts on its
address (a new process, a new kv_epoch) is handshaken again at once and used as soon as it
answers, and the rates learned from its predecessor start again from the priors.

    prefill A ── serves ──▶ stopped ──▶ prefill B on the same port
    decode: its cached handshake names A's kv_epoch
      next Prefill → B answers STALE_HANDSHAKE (did nothing) → Handshake(B) → Prefill → ok
      or: a GetStats answered by B → the handshake with B starts before any request
"""
from __future__ import annotations

import asyncio
import dataclasses
import time

import grpc

from baton.pd_cost import PRIOR_PREFILL_TOKENS_PER_S
from decode_service.peers import PeerLoad
from tests.reference import hf_greedy
from tests.services.helpers import FORCE_REMOTE, pools_whole
from prefill_service.server import PrefillServer
from tests.services.test_failures import prompt_of, sample


async def restart_prefill(cluster, old: PrefillServer) -> PrefillServer:
    """Stop `old` and start a new prefill process (a new kv_epoch) on its port."""
    await old.stop(drain_s=0)
    cluster.servers.remove(old)
    cfg = old.config
    new = await PrefillServer(dataclasses.replace(
        cfg, server=dataclasses.replace(cfg.server, port=old.port))).start()
    cluster.servers.append(new)
    return new


async def channel_ready(decode, address: str) -> None:
    """Until the decode worker's channel to `address` is connected again (bounded), so the
    next call reaches the new process instead of failing fast in gRPC's reconnect backoff."""
    channel = decode.peers._channel(address)
    for _ in range(200):
        if channel.get_state(try_to_connect=True) == grpc.ChannelConnectivity.READY:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"no connection to {address}")


async def start(cluster, model):
    prefill = await cluster.prefill(model, "grpc")
    decode = await cluster.decode(model, "grpc", prefill.address, **FORCE_REMOTE)
    client = cluster.client(decode)
    first = await client.generate(prompt_of(40, seed=1))
    assert first.fin.timings.remote_prefill
    return prefill, decode, client


async def test_restarted_prefill_worker_serves_the_next_remote_prefill(cluster, model):
    """The decode worker still holds the old process's handshake: the next Prefill is
    refused STALE_HANDSHAKE by the new process, sent again after a new handshake, and
    served there: outcome ok, not a recompute."""
    prefill, decode, client = await start(cluster, model)
    old_epoch = (await decode.peers.get(prefill.address)).kv_epoch
    rates = decode.worker.ctx.pd.estimator.peer(prefill.address)
    assert rates.remote.samples == 1
    prefill = await restart_prefill(cluster, prefill)
    await channel_ready(decode, prefill.address)

    prompt = prompt_of(40, seed=2)
    res = await client.generate(prompt)
    assert res.output == hf_greedy(model, prompt, 8) and res.fin.timings.remote_prefill
    assert sample(decode, "baton_decode_remote_prefills_total", outcome="ok") == 2
    assert sample(decode, "baton_decode_remote_prefills_total", outcome="recompute") == 0
    assert sample(prefill, "baton_prefill_requests_total", status="PREFILL_STATUS_OK") == 1
    peer = await decode.peers.get(prefill.address)
    assert peer.kv_epoch != old_epoch
    assert sample(decode, "baton_decode_prefill_peer_restarts_total") == 1
    # the rates learned from the old process were dropped: one sample, the new process's
    assert rates.kv_epoch == peer.kv_epoch and rates.remote.samples == 1
    await pools_whole(prefill, decode)


async def test_a_new_epoch_in_get_stats_handshakes_before_any_request(cluster, model):
    """A GetStats answer of the new process (the P/D decider's queue poll) is enough: the
    handshake with it is redone at once, the old one's rates go back to the priors."""
    prefill, decode, client = await start(cluster, model)
    old = await decode.peers.get(prefill.address)
    prefill = await restart_prefill(cluster, prefill)
    await channel_ready(decode, prefill.address)
    await decode.peers.num_steps(old, timeout_s=5.0)  # answered by the new process
    for _ in range(200):
        peer = decode.peers._peers.get(prefill.address)
        if peer is not None and peer.kv_epoch != old.kv_epoch:
            break
        await asyncio.sleep(0.02)
    else:
        raise AssertionError("no new handshake after GetStats showed a new kv_epoch")
    rates = decode.worker.ctx.pd.estimator.peer(prefill.address)
    assert rates.remote.samples == 0 and rates.remote.value == PRIOR_PREFILL_TOKENS_PER_S
    assert decode.metrics.registry.get_sample_value(
        "baton_decode_pd_learned_rate", {"kind": "remote_prefill_tokens_per_second",
                                         "peer": prefill.address}) == PRIOR_PREFILL_TOKENS_PER_S
    res = await client.generate(prompt_of(40, seed=3))
    assert res.fin.timings.remote_prefill
    assert sample(prefill, "baton_prefill_requests_total", status="PREFILL_STATUS_OK") == 1
    await pools_whole(prefill, decode)


async def test_steps_of_another_process_are_no_progress(cluster, model):
    """The remote prefill watchdog counts only the steps of the process that took the call:
    a restarted process stepping on the same address is not that call's progress."""
    prefill, decode, _ = await start(cluster, model)
    peer = await decode.peers.get(prefill.address)
    now = time.monotonic()
    decode.peers._loads[prefill.address] = PeerLoad(now, 5, 0, 0, 0, 0.0, peer.kv_epoch)
    assert await decode.peers.num_steps(peer, timeout_s=1.0, max_age_s=60.0) == 5
    decode.peers._loads[prefill.address] = PeerLoad(now, 6, 0, 0, 0, 0.0, peer.kv_epoch ^ 1)
    assert await decode.peers.num_steps(peer, timeout_s=1.0, max_age_s=60.0) is None


async def test_concurrent_requests_share_one_handshake(cluster, model):
    prefill = await cluster.prefill(model, "grpc")
    decode = await cluster.decode(model, "grpc", prefill.address, **FORCE_REMOTE)
    calls = 0
    shake = decode.peers._handshake

    async def counted(address):
        nonlocal calls
        calls += 1
        return await shake(address)
    decode.peers._handshake = counted
    peers = await asyncio.gather(*(decode.peers.get(prefill.address) for _ in range(8)))
    assert calls == 1 and all(p is peers[0] for p in peers)
