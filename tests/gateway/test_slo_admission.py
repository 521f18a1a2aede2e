"""SLO-aware admission (Mooncake's early rejection, gateway/admission.py): 429 +
Retry-After + slo_unattainable under a predicted overload, before any work; accepted when
the prediction fits; off by default."""
from __future__ import annotations

import asyncio

import grpc
import httpx
import pytest

from baton.pd_cost import PDPolicy
from gateway.admission import DEFAULT_CHUNK_TOKENS as CHUNK_TOKENS
from gateway.admission import PRIOR_TOKENS_PER_S, PathQueue, SLOAdmission

ITL_BUDGET_S, IDLE_BUDGET_S = PDPolicy().itl_budget_s, PDPolicy().idle_budget_s
from gateway.config import PrefillModeChoice, RouterConfig, RoutingPolicy
from gateway.errors import GatewayError
from gateway.workers import DECODE, PREFILL
from tests.gateway.conftest import MODEL, Behavior, FakeWorker
from tests.gateway.conftest import running_gateway as _running_gateway
from tests.gateway.fake_decode import start_fake_prefill

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hi there"}]}
OVERLOAD = 100_000  # queued prompt tokens: 50 s at the prior 2000 tokens/s


def running_gateway(prompts, workers, prefill_workers=(), **overrides):
    """The gateway with polled stats that stay fresh for the test's length: the predictions
    read the fakes' queues, which a loaded machine delaying one poll past the default 1 s
    would otherwise turn stale (read as empty) and so admit what the test expects refused."""
    router = RouterConfig(policy=RoutingPolicy.SESSION, stale_after_s=60.0)
    return _running_gateway(prompts, workers, prefill_workers, router=router, **overrides)


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


RATE = 350.0  # prompt tokens/s: this CPU's prefill worker on the bursts workload


def test_the_workers_measured_rate_sets_the_prediction():
    adm = SLOAdmission(slo_ttft_s=3.0)
    unmeasured, measured = PathQueue("d:1", 0), PathQueue("d:2", 0, tokens_per_s=RATE)
    assert adm.predict(1000, unmeasured).seconds == pytest.approx(1000 / PRIOR_TOKENS_PER_S)
    assert adm.predict(1000, measured).seconds == pytest.approx(1000 / RATE)
    # stats' queue (another gateway's work) counts beyond this gateway's own entries
    assert adm.predict(100, PathQueue("d:2", 700, RATE)).seconds == pytest.approx(800 / RATE)


def test_shortest_first_a_short_turn_is_not_behind_queued_long_prompts():
    """Workers prefill shortest first: two 1,500-token prompts admitted before a 100-token
    continuation put only one step's chunk ahead of it, and it is admitted; a 1,000-token
    prompt (2.9 s alone) is behind the chunk and misses the 3 s SLO: refused."""
    adm = SLOAdmission(slo_ttft_s=3.0)
    p = PathQueue("p:1", 0, RATE)
    adm.admit(1500, [p])                       # too long even idle, but the path was idle
    with pytest.raises(GatewayError):
        adm.admit(1500, [p])                   # too long even idle and the path is busy
    assert adm.pending_tokens("p:1") == 1500   # a refusal queues nothing
    short = adm.admit(100, [p])
    assert short.predicted_s == pytest.approx((CHUNK_TOKENS + 100) / RATE)
    with pytest.raises(GatewayError) as e:
        adm.admit(1000, [p])                   # behind the 100 and the chunk: 3.7 s
    assert (e.value.status, e.value.code, e.value.retry_after) == (429, "slo_unattainable", 1)


def test_too_long_even_idle_waits_for_the_queue_to_drain():
    adm = SLOAdmission(slo_ttft_s=1.0)
    p = PathQueue("p:1", 0, 1000.0)
    first = adm.admit(700, [p])
    with pytest.raises(GatewayError) as e:
        adm.admit(5000, [p])                   # 5 s even idle; 0.7 s of queue ahead
    assert e.value.retry_after == 1
    adm.release(first)
    assert adm.admit(5000, [p]).predicted_s == pytest.approx(5.0)  # idle now: admitted


def test_admitted_requests_without_a_first_token_count_as_queued():
    """A worker's stats are as old as its last poll: the gateway's own admitted-but-not-
    first-token tokens count as its queue, on every path the request may take, and
    releasing a ticket frees them (once)."""
    adm = SLOAdmission(slo_ttft_s=1.0)
    d, p = PathQueue("d:1", 0, 1000.0), PathQueue("p:1", 0, 1000.0)
    tickets = [adm.admit(400, [d, p]) for _ in range(2)]
    assert adm.pending_tokens("d:1") == adm.pending_tokens("p:1") == 800
    with pytest.raises(GatewayError):
        adm.admit(400, [d, p])                 # 1.2 s on either path > 1 s: refused
    adm.release(tickets[0])
    adm.release(tickets[0])                    # idempotent
    assert adm.pending_tokens("d:1") == adm.pending_tokens("p:1") == 400
    # stats that already count the request are not added to it: max(stats, own)
    assert adm.predict(400, PathQueue("d:1", 300, 1000.0)).ahead == 400


def test_the_path_is_the_one_the_pd_decider_takes():
    """A decode worker running sequences sends a prompt whose local prefill would stall
    them past its ITL budget to the prefill worker, however busy: predicted there."""
    adm = SLOAdmission(slo_ttft_s=1.0)
    idle_decode = PathQueue("d:1", 0, 1000.0)
    busy_prefill = PathQueue("p:1", 2000, 1000.0)
    assert adm.admit(100, [idle_decode, busy_prefill]).predicted_s == pytest.approx(0.1)
    running = PathQueue("d:1", 0, 1000.0, num_running=3)
    with pytest.raises(GatewayError):
        adm.admit(100, [running, busy_prefill])  # 0.1 s locally > the budget: remote, 2.2 s
    short = int(1000.0 * ITL_BUDGET_S / 2)     # fits the budget: the faster path
    assert SLOAdmission(slo_ttft_s=1.0).admit(short, [running, busy_prefill]).predicted_s \
        == pytest.approx(short / 1000.0)


def test_idle_decode_past_the_idle_budget_is_predicted_on_the_prefill_worker():
    """As the decider: decode idle, a 400-token prompt (0.4 s locally, past the 0.25 s idle
    budget) goes to the prefill worker although local is no slower, unless the prefill
    worker's queue costs it more than the local stall."""
    adm = SLOAdmission(slo_ttft_s=5.0)
    idle_decode = PathQueue("d:1", 0, 1000.0)
    slow_prefill = PathQueue("p:1", 0, 800.0)  # 0.5 s there vs 0.4 s here: still remote
    assert adm.choose([adm.predict(400, idle_decode), adm.predict(400, slow_prefill)],
                      idle_decode, 400).address == "p:1"
    saturated = PathQueue("p:1", 2000, 1000.0)  # 2.4 s there: 2.0 s more than the stall
    assert adm.choose([adm.predict(400, idle_decode), adm.predict(400, saturated)],
                      idle_decode, 400).address == "d:1"
    within = int(1000.0 * IDLE_BUDGET_S / 2)  # under the idle budget: the faster path
    assert adm.choose([adm.predict(within, idle_decode), adm.predict(within, slow_prefill)],
                      idle_decode, within).address == "d:1"


def test_the_prediction_uses_the_policy_and_chunk_the_workers_publish():
    """A decode worker started with other budgets (or a fixed threshold) is predicted with
    them, not with the defaults; a worker's chunk is its own --prefill-target-tokens."""
    adm = SLOAdmission(slo_ttft_s=5.0)
    slow_prefill = PathQueue("p:1", 0, 800.0)
    wide = PathQueue("d:1", 0, 1000.0, policy=PDPolicy(itl_budget_s=0.5, idle_budget_s=0.5))
    preds = [adm.predict(400, wide), adm.predict(400, slow_prefill)]
    assert adm.choose(preds, wide, 400).address == "d:1"  # 0.4 s fits its 0.5 s budget
    fixed = PathQueue("d:1", 0, 1000.0, policy=PDPolicy(min_remote_tokens=10_000))
    assert adm.choose(preds, fixed, 400).address == "d:1"  # below its threshold: local
    adm.admit(3000, [PathQueue("p:2", 0, 1000.0, chunk_tokens=64)])
    assert adm.predict(100, PathQueue("p:2", 0, 1000.0, chunk_tokens=64)).ahead == 64
    # a busy decode sharing its cores with the prefill worker (`--pin share`) is predicted
    # to take the faster path, here its own; on cores of its own, the remote one
    p330 = PathQueue("p:3", 0, 330.0)
    shared = PathQueue("d:2", 0, 590.0, 3, policy=PDPolicy(remote_stall_fraction=0.5))
    own = PathQueue("d:2", 0, 590.0, 3)
    preds = [adm.predict(300, shared), adm.predict(300, p330)]
    assert adm.choose(preds, shared, 300).address == "d:2"
    assert adm.choose(preds, own, 300).address == "p:3"


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
