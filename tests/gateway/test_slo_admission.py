"""SLO-aware admission (Mooncake's early rejection, gateway/admission.py): 429 +
Retry-After + slo_unattainable under a predicted overload, before any work; accepted when
the prediction fits; off by default."""
from __future__ import annotations

import asyncio

import grpc
import httpx
import pytest

from gateway.admission import PRIOR_SECONDS_PER_TOKEN, PathQueue, SLOAdmission, Ticket
from gateway.config import PrefillModeChoice
from gateway.errors import GatewayError
from gateway.workers import DECODE, PREFILL
from tests.gateway.conftest import MODEL, Behavior, FakeWorker, running_gateway
from tests.gateway.fake_decode import start_fake_prefill

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hi there"}]}
OVERLOAD = 100_000  # queued prompt tokens: 50 s at the prior 2000 tokens/s


async def chat(gw) -> httpx.Response:
    async with httpx.AsyncClient(base_url=gw.http_url, timeout=10) as c:
        return await c.post("/v1/chat/completions", json=CHAT)


async def polled(gw, role: str, worker: FakeWorker) -> None:
    for _ in range(200):
        w = gw.pool.get(role, worker.address)
        if w is not None and w.stats is not None:
            return
        await asyncio.sleep(0.01)
    raise AssertionError("worker stats never polled")


def rejections(gw) -> float:
    return gw.metrics.registry.get_sample_value("baton_gateway_slo_rejections_total") or 0


async def test_predicted_overload_gets_429_before_any_work(prompts):
    fake = await FakeWorker.start(num_waiting_tokens=OVERLOAD)
    try:
        async with running_gateway(prompts, [fake], slo_ttft_ms=500) as gw:
            await polled(gw, DECODE, fake)
            r = await chat(gw)
            assert r.status_code == 429, r.text
            assert 49 <= int(r.headers["Retry-After"]) <= 51
            err = r.json()["error"]
            assert (err["code"], err["type"]) == ("slo_unattainable", "rate_limit_error")
            assert "500 ms SLO" in err["message"]
            assert fake.servicer.requests == []  # refused before Generate
            assert rejections(gw) == 1
    finally:
        await fake.stop(0)


async def test_accepted_when_the_prediction_fits(prompts):
    fake = await FakeWorker.start(num_waiting_tokens=200)  # 0.1 s of queue
    try:
        async with running_gateway(prompts, [fake], slo_ttft_ms=500) as gw:
            await polled(gw, DECODE, fake)
            r = await chat(gw)
            assert r.status_code == 200, r.text
            assert len(fake.servicer.requests) == 1 and rejections(gw) == 0
    finally:
        await fake.stop(0)


async def test_off_by_default(prompts):
    fake = await FakeWorker.start(num_waiting_tokens=OVERLOAD)
    try:
        async with running_gateway(prompts, [fake]) as gw:
            assert gw.config.slo_ttft_ms is None
            await polled(gw, DECODE, fake)
            assert (await chat(gw)).status_code == 200
            assert rejections(gw) == 0
    finally:
        await fake.stop(0)


@pytest.mark.parametrize("mode,status", [(PrefillModeChoice.AUTO, 200),
                                         (PrefillModeChoice.LOCAL, 429)])
async def test_an_idle_prefill_worker_is_a_way_out_unless_prefill_is_local(prompts, mode,
                                                                           status):
    fake = await FakeWorker.start(num_waiting_tokens=OVERLOAD)
    prefill = await start_fake_prefill(num_waiting_tokens=0)
    try:
        async with running_gateway(prompts, [fake], [prefill], slo_ttft_ms=500,
                                   prefill_mode=mode) as gw:
            await polled(gw, DECODE, fake)
            await polled(gw, PREFILL, prefill)
            assert (await chat(gw)).status_code == status
    finally:
        await fake.stop(0)
        await prefill.stop(0)


def test_learned_rate_from_observed_ttft_tightens_the_prediction():
    adm = SLOAdmission(slo_ttft_s=0.5)
    decode = PathQueue("d:1", 0)
    assert adm.admit(1000, decode, None, [decode]).predicted_s == \
        pytest.approx(1000 * PRIOR_SECONDS_PER_TOKEN)
    for _ in range(40):  # the worker really does 1000 tokens/s: TTFT 1 ms per token
        t = Ticket(decode, None, 0.0, ttft_s=1.0)
        adm.observe(t, remote_prefill=False, uncached=1000)
    assert adm.seconds_per_token("d:1") == pytest.approx(1e-3, rel=1e-3)
    busy = PathQueue("d:1", 600)
    with pytest.raises(GatewayError) as e:
        adm.admit(100, busy, None, [busy])  # 0.7 s > 0.5 s; idle 0.1 s fits
    assert (e.value.status, e.value.code, e.value.retry_after) == (429, "slo_unattainable", 1)
    adm.admit(5000, decode, None, [decode])  # too long even idle: refusing would not help
    adm.observe(Ticket(decode, None, 0.0, ttft_s=5.0), False, uncached=10)  # too small
    assert adm.seconds_per_token("d:1") == pytest.approx(1e-3, rel=1e-3)


def test_admitted_requests_without_a_first_token_count_as_queued():
    """A worker's stats leave out what it is prefilling and what arrived since the last
    poll: the gateway's own admitted-but-not-first-token tokens count as its queue, so a
    burst is refused once it would queue past the SLO, and releasing a ticket frees it."""
    adm = SLOAdmission(slo_ttft_s=1.0, prior_s_per_token=1e-3)  # 1000 tokens/s
    decode = PathQueue("d:1", 0)                                # stats: idle
    tickets = [adm.admit(400, decode, None, [decode]) for _ in range(2)]
    assert adm.pending_tokens("d:1") == 800
    assert tickets[1].decode.waiting_tokens == 400            # the first one counted
    with pytest.raises(GatewayError):
        adm.admit(400, decode, None, [decode])                 # 1.2 s > 1 s: refused
    assert adm.pending_tokens("d:1") == 800                    # a refusal queues nothing
    adm.release(tickets[0])
    adm.release(tickets[0])                                    # idempotent
    assert adm.pending_tokens("d:1") == 400
    assert adm.admit(400, PathQueue("d:1", 100), None, [PathQueue("d:1", 100)])
    assert adm.pending_tokens("d:1") == 800                    # max(stats, own), not the sum
    # the path predicted cheaper gets the tokens: an idle prefill worker beside a busy decode
    busy, idle = PathQueue("d:1", 0), PathQueue("p:1", 0)
    t = adm.admit(100, busy, idle, [busy, idle])
    assert t.path == "p:1" and adm.pending_tokens("p:1") == 100


@pytest.mark.parametrize("behavior", [Behavior(), Behavior(reject=grpc.StatusCode.INTERNAL),
                                      Behavior(fail_after=1)])
async def test_no_admitted_tokens_stay_queued_after_a_request_ends(prompts, behavior):
    """Served, refused by the worker, or broken mid-stream: afterwards nothing of the
    request is counted as queued on its worker (a leak would refuse everything later)."""
    fake = await FakeWorker.start(behavior, num_waiting_tokens=0)
    try:
        async with running_gateway(prompts, [fake], slo_ttft_ms=60_000) as gw:
            await polled(gw, DECODE, fake)
            for _ in range(3):
                await chat(gw)
            assert gw.dispatcher.admission.pending_tokens(fake.address) == 0
    finally:
        await fake.stop(0)
