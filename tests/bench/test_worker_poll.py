"""The worker-metrics poller: parsing an exposition, polling Baton, skipping anyone else."""
import asyncio

import pytest

from baton.bench.worker_poll import WorkerPoller, WorkerSample, parse_workers
from tests.bench.fake_server import FakeServer, ServerThread

SAMPLE = """\
# HELP baton_worker_metrics_up 1 when the worker's /metrics answered this scrape
# TYPE baton_worker_metrics_up gauge
baton_worker_metrics_up{role="decode",worker="10.0.0.1:50051"} 1.0
baton_worker_metrics_up{role="prefill",worker="10.0.0.2:50052"} 1.0
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m",role="decode",worker="10.0.0.1:50051"} 3.0
vllm:num_requests_running{engine="1",model_name="m",role="decode",worker="10.0.0.1:50051"} 2.0
vllm:num_requests_running{engine="0",model_name="m",role="prefill",worker="10.0.0.2:50052"} 1.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m",role="decode",worker="10.0.0.1:50051"} 4.0
vllm:num_requests_waiting{engine="0",model_name="m",role="prefill",worker="10.0.0.2:50052"} 0.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="m",role="decode",worker="10.0.0.1:50051"} 0.25
vllm:kv_cache_usage_perc{engine="1",model_name="m",role="decode",worker="10.0.0.1:50051"} 0.5
# HELP vllm:prefix_cache_hits_total Prefix cache hits, in terms of number of cached tokens.
# TYPE vllm:prefix_cache_hits_total counter
vllm:prefix_cache_hits_total{engine="0",model_name="m",role="decode",worker="10.0.0.1:50051"} 9.0
"""


def test_parse_sample_exposition():
    workers = parse_workers(SAMPLE)
    assert workers == {
        "10.0.0.1:50051": WorkerSample("decode", running=5.0, waiting=4.0, kv_usage=0.5),
        "10.0.0.2:50052": WorkerSample("prefill", running=1.0, waiting=0.0, kv_usage=None),
    }
    assert parse_workers("") == {}
    with pytest.raises(ValueError):
        parse_workers("<html>not found</html>")


async def _poll(url: str, seconds: float, polls: int = 0):
    """Run a poller for `seconds`, or until it has `polls` answers (bounded by 20 s: a
    loaded machine polls slower, so the count, not the time, is what the test waits on)."""
    poller = WorkerPoller(url, interval_s=0.05, timeout_s=1.0)
    task = asyncio.create_task(poller.run())
    await asyncio.sleep(seconds)
    for _ in range(400):
        if poller.series(0.0).polls >= polls or task.done():
            break
        await asyncio.sleep(0.05)
    poller.stop()
    await asyncio.wait_for(task, 5)
    return poller


def test_poller_series_from_baton(fake):
    _, url = fake
    poller = asyncio.run(_poll(url, 0.1, polls=2))  # stop() adds the run's last poll
    series = poller.series(origin=0.0).to_dict()
    assert series["available"] and series["note"] is None and series["polls"] >= 3
    decode = series["workers"]["127.0.0.1:50051"]
    assert decode["role"] == "decode"
    assert len(decode["t"]) == len(decode["running"]) == len(decode["kv_usage"]) == series["polls"]
    assert decode["t"] == sorted(decode["t"])


def test_poller_skips_quietly_on_404():
    with ServerThread(FakeServer(baton=False).app()) as url:
        poller = asyncio.run(_poll(url, 0.3))
    series = poller.series(origin=0.0)
    assert not series.available and series.polls == 0 and series.workers == {}
    assert "HTTP 404" in series.note and "/metrics/workers" in series.note


def test_poller_counts_failures_after_a_good_poll(fake):
    server, url = fake

    async def until(poller, field: str) -> None:
        for _ in range(400):  # on the poller's own progress, not a fixed time (≤ 20 s)
            if getattr(poller.series(0.0), field) >= 1:
                return
            await asyncio.sleep(0.05)

    async def run():
        poller = WorkerPoller(url, interval_s=0.05)
        task = asyncio.create_task(poller.run())
        await until(poller, "polls")
        server.worker_metrics = lambda: "garbage text here"   # a broken scrape mid-run
        await until(poller, "failed_polls")
        poller.stop()
        await task
        return poller.series(origin=0.0)

    series = asyncio.run(run())
    assert series.available and series.polls >= 1 and series.failed_polls >= 1


def _with_held(tokens: float) -> str:
    return SAMPLE + f"""\
# HELP baton_decode_recomputed_held_tokens_total held but recomputed
# TYPE baton_decode_recomputed_held_tokens_total counter
baton_decode_recomputed_held_tokens_total{{role="decode",worker="10.0.0.1:50051"}} {tokens}
baton_decode_recomputed_held_tokens_created{{role="decode",worker="10.0.0.1:50051"}} 1.7e9
"""


def test_counter_delta_over_the_run():
    from baton.bench.worker_poll import WorkerSeries
    series = WorkerSeries(True)
    series.add(0.0, parse_workers(_with_held(40)))
    assert parse_workers(_with_held(40))["10.0.0.1:50051"].recomputed_held == 40.0
    series.add(1.0, parse_workers(_with_held(40)))
    series.add(2.0, parse_workers(_with_held(72)))
    assert series.counter_delta("recomputed_held") == 32
    assert series.counter_delta("tier_recomputed_blocks") is None  # no worker has it
    assert series.to_dict()["recomputed_held_delta"] == 32
    series.add(3.0, parse_workers(_with_held(5)))  # restarted: all 5 are new
    assert series.counter_delta("recomputed_held") == 5


def test_poller_polls_once_more_when_stopped(fake):
    server, url = fake
    server.worker_metrics = lambda: _with_held(3)

    async def run():
        poller = WorkerPoller(url, interval_s=600)
        task = asyncio.create_task(poller.run())
        for _ in range(200):  # until the first poll is in (bounded)
            if poller.series(0.0).polls:
                break
            await asyncio.sleep(0.01)
        server.worker_metrics = lambda: _with_held(11)
        poller.stop()
        await asyncio.wait_for(task, 5)
        return poller.series(origin=0.0)

    series = asyncio.run(run())
    assert series.polls == 2 and series.counter_delta("recomputed_held") == 8
