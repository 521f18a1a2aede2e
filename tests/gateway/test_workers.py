"""Worker pool and routing end to end: stats, discovery, dead workers, stale stats, prefill."""
from __future__ import annotations

import asyncio
import socket
import time

import grpc
import httpx

from baton.block_hash import hash_block_tokens
from gateway.config import RoutingPolicy
from baton.cluster.plan import write_workers_file
from gateway.workers import FILE_CHECK_S, Worker, apply_stats, read_workers_file, resolve
from protos import common_pb2
from tests.gateway.conftest import MODEL, FakeWorker, gateway_config, running_gateway
from tests.gateway.fake_decode import start_fake_prefill

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]}


def _worker() -> Worker:
    return Worker("a:1", "decode", channel=None, stub=None, health=None)


def test_stats_snapshot_replaces_hashes_and_keeps_epoch():
    w = _worker()
    snap = common_pb2.WorkerStats(load=0.5, kv_epoch=9)
    snap.snapshot.block_hashes.extend([1, 2, 3])
    apply_stats(w, snap, 1.0)
    assert w.block_hashes == {1, 2, 3} and w.kv_epoch == 9
    again = common_pb2.WorkerStats(kv_epoch=9)
    again.snapshot.block_hashes.extend([2, 3, 4])
    apply_stats(w, again, 2.0)
    assert w.block_hashes == {2, 3, 4}  # a full snapshot, never merged
    apply_stats(w, common_pb2.WorkerStats(kv_epoch=9), 2.5)  # hashes not asked for
    assert w.block_hashes == {2, 3, 4} and w.stats_at == 2.5
    restarted = common_pb2.WorkerStats(kv_epoch=10)
    restarted.snapshot.block_hashes.extend([8])
    apply_stats(w, restarted, 3.0)
    assert w.block_hashes == {8} and w.kv_epoch == 10


def test_a_restart_reported_without_a_snapshot_leaves_no_old_hashes():
    """A new kv_epoch is a new process: what the old one held is gone even when the reply
    carries no hashes (not asked for); apply_stats says it restarted."""
    w = _worker()
    snap = common_pb2.WorkerStats(kv_epoch=9)
    snap.snapshot.block_hashes.extend([1, 2, 3])
    assert apply_stats(w, snap, 1.0) is False  # the first stats: no restart
    assert apply_stats(w, common_pb2.WorkerStats(kv_epoch=9), 2.0) is False
    assert w.block_hashes == {1, 2, 3}
    assert apply_stats(w, common_pb2.WorkerStats(kv_epoch=10), 3.0) is True
    assert w.block_hashes == set() and w.kv_epoch == 10


def test_stale_stats_read_as_unknown_load():
    w = _worker()
    apply_stats(w, common_pb2.WorkerStats(load=9.0), now=100.0)
    w.inflight = 3
    assert w.view(101.0, stale_after_s=3.0).load == 9.0
    stale = w.view(110.0, stale_after_s=3.0)
    assert stale.load is None and stale.pending == 3 and not stale.cached


async def test_resolve_names_to_every_a_record(monkeypatch):
    assert await resolve("10.1.2.3:80") == ["10.1.2.3:80"]
    assert await resolve("localhost:81") == ["127.0.0.1:81"]

    def fake_getaddrinfo(host, port, family=0, type=0, proto=0, flags=0):
        assert host == "decode-svc"
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (ip, port))
                for ip in ("10.0.0.2", "10.0.0.1", "10.0.0.2")]
    monkeypatch.setattr(socket, "getaddrinfo", fake_getaddrinfo)
    assert await resolve("decode-svc:50051") == ["10.0.0.1:50051", "10.0.0.2:50051"]


async def test_resolve_ipv6_only_names_and_literals(monkeypatch):
    assert await resolve("[fd00::7]:80") == ["[fd00::7]:80"]

    def fake_getaddrinfo(host, port, family=0, type=0, proto=0, flags=0):
        return [(socket.AF_INET6, socket.SOCK_STREAM, 6, "", (ip, port, 0, 0))
                for ip in ("fd00::2", "fd00::1")]
    monkeypatch.setattr(socket, "getaddrinfo", fake_getaddrinfo)
    assert await resolve("decode-v6:50051") == ["[fd00::1]:50051", "[fd00::2]:50051"]


def test_workers_file(tmp_path):
    yml = tmp_path / "w.yaml"
    yml.write_text("decode: ['127.0.0.1:1', 'decode-svc:2']\nprefill: ['127.0.0.1:3']\n")
    assert read_workers_file(str(yml)) == {"decode": ["127.0.0.1:1", "decode-svc:2"],
                                           "prefill": ["127.0.0.1:3"]}
    js = tmp_path / "w.json"
    js.write_text('{"decode": ["nope"]}')
    try:
        read_workers_file(str(js))
    except ValueError as e:
        assert "host:port" in str(e)
    else:
        raise AssertionError("a bad address must be refused")


async def test_workers_file_is_reread(prompts, tmp_path):
    a, b = await FakeWorker.start(), await FakeWorker.start()
    path = tmp_path / "workers.yaml"
    path.write_text(f"decode: ['{a.address}']\n")
    async with running_gateway(prompts, [], workers_file=str(path)) as gw:
        assert list(gw.pool.workers["decode"]) == [a.address]
        path.write_text(f"decode: ['{b.address}']\n")
        await gw.pool.refresh()
        assert list(gw.pool.workers["decode"]) == [b.address]
        async with httpx.AsyncClient(base_url=gw.http_url) as c:
            assert (await c.post("/v1/chat/completions", json=CHAT)).status_code == 200
    assert len(b.servicer.requests) == 1 and not a.servicer.requests
    for w in (a, b):
        await w.stop(0)


async def test_a_changed_workers_file_is_read_within_a_fraction_of_a_second(prompts, tmp_path):
    """As `baton up` starts it: no workers yet; they appear when the file is rewritten,
    without waiting for --dns-refresh-s (600 s here)."""
    a = await FakeWorker.start()
    path = tmp_path / "workers.json"
    write_workers_file(path, [], [])
    async with running_gateway(prompts, [], workers_file=str(path), dns_refresh_s=600.0) as gw:
        assert not gw.pool.workers["decode"]
        write_workers_file(path, [a.address], [])
        await wait_until(lambda: list(gw.pool.workers["decode"]) == [a.address],
                         timeout=10 * FILE_CHECK_S)
        async with httpx.AsyncClient(base_url=gw.http_url) as c:
            assert (await c.post("/v1/chat/completions", json=CHAT)).status_code == 200
    assert len(a.servicer.requests) == 1
    await a.stop(0)


async def wait_until(predicate, timeout: float = 3.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline
        await asyncio.sleep(0.02)


async def test_session_sticks_then_moves_when_its_worker_dies(prompts):
    a, b = await FakeWorker.start(), await FakeWorker.start()
    async with running_gateway(prompts, [a, b]) as gw:
        async with httpx.AsyncClient(base_url=gw.http_url, timeout=5) as c:
            for _ in range(4):
                r = await c.post("/v1/chat/completions", json=CHAT, headers={"X-Session-ID": "s"})
                assert r.status_code == 200
            sticky, other = (a, b) if a.servicer.requests else (b, a)
            assert len(sticky.servicer.requests) == 4 and not other.servicer.requests
            await sticky.stop(0)
            r = await c.post("/v1/chat/completions", json=CHAT, headers={"X-Session-ID": "s"})
            assert r.status_code == 200
            assert len(other.servicer.requests) == 1
            assert gw.router.session_of("s")[0] == other.address
    await other.stop(0)


async def test_restarted_decode_worker_keeps_its_sessions_not_their_blocks(prompts):
    """A decode worker that restarts (new kv_epoch in its stats) is counted; the session
    routed there stays on it, but nothing it was sent or held counts as cached any more."""
    a = await FakeWorker.start()
    async with running_gateway(prompts, [a]) as gw:
        async with httpx.AsyncClient(base_url=gw.http_url, timeout=5) as c:
            r = await c.post("/v1/chat/completions", json=CHAT, headers={"X-Session-ID": "s"})
            assert r.status_code == 200
            assert gw.router._sent.get(a.address)  # the gateway expects its prefix there
            a.servicer.kv_epoch = 2  # a new process on the same address
            restarts = lambda: gw.metrics.registry.get_sample_value(  # noqa: E731
                "baton_gateway_worker_restarts_total", {"role": "decode"})
            await wait_until(lambda: restarts() == 1)
            assert not gw.router._sent.get(a.address)
            assert gw.router.session_of("s")[0] == a.address
            r = await c.post("/v1/chat/completions", json=CHAT, headers={"X-Session-ID": "s"})
            assert r.status_code == 200 and len(a.servicer.requests) == 2
            assert gw.metrics.registry.get_sample_value(
                "baton_gateway_routing_decisions_total",
                {"policy": "session", "reason": "sticky"}) == 1
    await a.stop(0)


async def test_routing_recovers_from_stale_stats(prompts):
    """Case 14: an overloaded report that is never refreshed stops counting."""
    a, b = await FakeWorker.start(load=10.0), await FakeWorker.start(load=0.0)
    async with running_gateway(prompts, [a, b]) as gw:
        await wait_until(lambda: all(w.stats for w in gw.pool.workers["decode"].values()))
        async with httpx.AsyncClient(base_url=gw.http_url, timeout=5) as c:
            await c.post("/v1/chat/completions", json=CHAT)
            assert len(b.servicer.requests) == 1  # a is overloaded
            a.servicer.fail_stats = True           # a stays healthy but stops reporting
            b.servicer.load = 10.0
            await asyncio.sleep(1.3)               # > stale_after_s (1.0 in tests)
            assert gw.pool.get("decode", a.address).healthy
            await c.post("/v1/chat/completions", json=CHAT)
            assert len(a.servicer.requests) == 1   # unknown load beats fresh overload
    for w in (a, b):
        await w.stop(0)


async def test_kv_overlap_routes_to_the_worker_holding_the_prefix(prompts):
    a, b = await FakeWorker.start(), await FakeWorker.start()
    async with running_gateway(prompts, [a, b], policy=RoutingPolicy.KV) as gw:
        await wait_until(lambda: gw.pool.block_size() == 4)
        ids = prompts.chat_token_ids(CHAT["messages"])
        b.servicer.block_hashes = hash_block_tokens(ids, 4)
        await wait_until(lambda: gw.pool.get("decode", b.address).block_hashes)
        async with httpx.AsyncClient(base_url=gw.http_url, timeout=5) as c:
            for _ in range(3):
                await c.post("/v1/chat/completions", json=CHAT)
        assert len(b.servicer.requests) == 3 and not a.servicer.requests
        text = (await httpx.AsyncClient(base_url=gw.http_url).get("/metrics")).text
        assert 'baton_gateway_routing_decisions_total{policy="kv",reason="kv"} 3.0' in text
    for w in (a, b):
        await w.stop(0)


async def test_prefill_address_is_sent_and_dropped_when_prefill_is_down(prompts):
    decode, prefill = await FakeWorker.start(), await start_fake_prefill()
    async with running_gateway(prompts, [decode], [prefill]) as gw:
        await wait_until(lambda: gw.pool.num_healthy("prefill") == 1)
        async with httpx.AsyncClient(base_url=gw.http_url, timeout=5) as c:
            await c.post("/v1/chat/completions", json=CHAT)
            req = decode.servicer.requests[-1]
            assert req.prefill_address == prefill.address and req.prefill_mode == 1  # AUTO
            await prefill.stop(0)
            await wait_until(lambda: gw.pool.num_healthy("prefill") == 0)
            await c.post("/v1/chat/completions", json=CHAT)
            req = decode.servicer.requests[-1]
            assert not req.HasField("prefill_address") and req.prefill_mode == 2  # LOCAL
    await decode.stop(0)


def test_config_rejects_bad_addresses():
    import pytest
    with pytest.raises(ValueError):
        gateway_config(["no-port"])
    with pytest.raises(ValueError):
        gateway_config([])


class _Rpc:
    """A stub method: its results in turn (an exception is raised), the last one for good."""

    def __init__(self, *results) -> None:
        self.results = list(results)

    async def __call__(self, request, timeout=None):
        r = self.results.pop(0) if len(self.results) > 1 else self.results[0]
        if isinstance(r, BaseException):
            raise r
        return r


def _rpc_error(code: grpc.StatusCode) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), "x")


async def test_a_slow_health_check_is_busy_not_gone_but_a_refusal_counts_at_once():
    """Health checks that time out (a worker busy with a long step, a loaded host) take it
    out of routing only from the third in a row; a refused call or NOT_SERVING at once."""
    from types import SimpleNamespace

    from grpc_health.v1 import health_pb2

    from gateway.workers import SLOW_POLLS_TO_UNHEALTHY, WorkerPool
    pool = WorkerPool(gateway_config(["127.0.0.1:1"]))
    serving = health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVING)
    slow = _rpc_error(grpc.StatusCode.DEADLINE_EXCEEDED)
    w = Worker("a:1", "decode", channel=None,
               stub=SimpleNamespace(GetStats=_Rpc(common_pb2.WorkerStats())),
               health=SimpleNamespace(Check=_Rpc(serving)))
    await pool.poll_once(w)
    assert w.healthy is True
    w.health.Check = _Rpc(slow)
    for _ in range(SLOW_POLLS_TO_UNHEALTHY - 1):
        await pool.poll_once(w)
        assert w.healthy is True
    await pool.poll_once(w)
    assert w.healthy is False and "DEADLINE_EXCEEDED" in w.last_error
    w.health.Check = _Rpc(slow, serving)  # one late answer, then a good one: counts reset
    await pool.poll_once(w)
    await pool.poll_once(w)
    assert w.healthy is True and w.slow_polls == 0
    w.health.Check = _Rpc(_rpc_error(grpc.StatusCode.UNAVAILABLE))
    await pool.poll_once(w)
    assert w.healthy is False
