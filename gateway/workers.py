"""Worker discovery, gRPC channels, health checks and stats polling: the routing table's soft state.

    specs (--decode/--prefill, --workers-file) ──resolve every dns_refresh_s──▶ addresses
    per address: channel + poll loop every poll_interval_s:
        grpc.health.v1 Check("")   SERVING → healthy; NOT_SERVING or no answer → unhealthy
                                   (a check that only timed out counts from the third in a
                                   row: a busy worker answers late, it is not gone)
        GetStats                   load and block hashes; a failure only lets them go stale
                                   (no health service: GetStats answering = healthy)

A worker that fails a call (UNAVAILABLE) is marked unhealthy at once (`mark_failed`), so the
next request goes elsewhere without waiting for a poll. Block hashes arrive as a full
snapshot (protos/common.proto); a new kv_epoch means the worker restarted: its old hashes go
(a reply without a snapshot leaves none), what this gateway sent it is forgotten
(`on_worker_removed`: the router's sent index) and the restart is counted
(`on_worker_restarted`). Sessions routed there stay: only what they expected it to hold
resets, so their next turn is routed and admitted as a cold prompt on the worker.
"""
from __future__ import annotations

import asyncio
import ipaddress
import json
import logging
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from baton.grpc_options import CHANNEL_OPTIONS as BASE_CHANNEL_OPTIONS, with_options
from baton.pd_cost import PDPolicy
from gateway.admission import PathQueue
from gateway.config import GatewayConfig, split_host_port
from gateway.router import WorkerView
from protos import common_pb2, decode_pb2_grpc, prefill_pb2_grpc

logger = logging.getLogger(__name__)
FILE_CHECK_S = 0.2  # how often the workers file's stamp is looked at (one stat call)
# Health checks in a row that may time out before a worker counts as unhealthy: a refused
# connection or NOT_SERVING counts at once, but a worker busy with a long step (or a loaded
# host) answers late, and taking it out of routing for that turns load into 503s (as
# Kubernetes' probes, failureThreshold 3).
SLOW_POLLS_TO_UNHEALTHY = 3

DECODE, PREFILL = "decode", "prefill"

# The shared options, with a faster keepalive that also runs on idle channels (between
# polls no call is open): a dead worker is noticed within ~15 s, not at the next call.
# Message limits stay the shared 16 MiB: a worker's server sends no bigger answer (stats
# snapshots included), so a larger receive limit here could never be used.
CHANNEL_OPTIONS = with_options(BASE_CHANNEL_OPTIONS, keepalive_time_ms=10_000,
                               keepalive_timeout_ms=5_000, keepalive_permit_without_calls=1)


@dataclass
class Worker:
    """One worker as the gateway sees it. healthy None = not polled yet (routable)."""

    address: str
    role: str
    channel: grpc.aio.Channel
    stub: object
    health: health_pb2_grpc.HealthStub
    healthy: bool | None = None
    stats: common_pb2.WorkerStats | None = None
    stats_at: float = 0.0
    block_hashes: set[int] = field(default_factory=set)
    kv_epoch: int = 0          # epoch of the hashes we hold (0 = no stats yet)
    inflight: int = 0
    started_since_stats: int = 0
    last_error: str = ""
    poller: asyncio.Task | None = None
    polled: asyncio.Event = field(default_factory=asyncio.Event)  # set after its first poll
    slow_polls: int = 0        # health checks in a row that timed out (the worker may be busy)

    def view(self, now: float, stale_after_s: float) -> WorkerView:
        fresh = self.stats is not None and now - self.stats_at <= stale_after_s
        return WorkerView(
            address=self.address, healthy=self.healthy is not False,
            load=self.stats.load if fresh else None,
            pending=self.started_since_stats if fresh else self.inflight,
            cached=self.block_hashes if fresh else frozenset())


def apply_stats(worker: Worker, stats: common_pb2.WorkerStats, now: float) -> bool:
    """Take a GetStats reply: load, its epoch, and the block-hash snapshot when it has one.
    True when the epoch changed (the worker restarted): the hashes of its predecessor go,
    replaced by the snapshot or by none."""
    restarted = bool(worker.kv_epoch) and stats.kv_epoch != worker.kv_epoch
    if stats.HasField("snapshot"):
        worker.block_hashes = set(stats.snapshot.block_hashes)
    elif restarted:
        worker.block_hashes = set()
    worker.kv_epoch = stats.kv_epoch
    worker.stats, worker.stats_at, worker.started_since_stats = stats, now, 0
    return restarted


def _file_stamp(path: str | None) -> tuple[int, ...] | None:
    """(inode, mtime_ns, ctime_ns, size) of the workers file (a rename or an edit changes
    it); None without one or when it is missing."""
    try:
        st = Path(path).stat() if path else None
    except OSError:
        return None
    return None if st is None else (st.st_ino, st.st_mtime_ns, st.st_ctime_ns, st.st_size)


def read_workers_file(path: str) -> dict[str, list[str]]:
    """{'decode': [...], 'prefill': [...]} from a YAML or JSON file."""
    text = Path(path).read_text()
    if path.endswith(".json"):
        data = json.loads(text)
    else:
        import yaml
        data = yaml.safe_load(text) or {}
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a mapping with 'decode' and 'prefill' lists")
    out = {}
    for role in (DECODE, PREFILL):
        items = data.get(role) or []
        if not isinstance(items, list) or not all(isinstance(a, str) for a in items):
            raise ValueError(f"{path}: '{role}' must be a list of host:port strings")
        for a in items:
            split_host_port(a)
        out[role] = items
    return out


async def resolve(spec: str) -> list[str]:
    """host:port → one 'ip:port' per address of host (an IP literal is kept as is). IPv4
    addresses when the name has any (a dual-stack name such as localhost is one worker, not
    two), else its IPv6 ones as '[ip]:port'."""
    host, port = split_host_port(spec)
    try:
        ipaddress.ip_address(host)
        return [spec]
    except ValueError:
        pass
    infos = await asyncio.get_running_loop().getaddrinfo(
        host, port, family=socket.AF_UNSPEC, type=socket.SOCK_STREAM)
    v4 = {f"{i[4][0]}:{port}" for i in infos if i[0] == socket.AF_INET}
    return sorted(v4 or {f"[{i[4][0]}]:{port}" for i in infos if i[0] == socket.AF_INET6})


class WorkerPool:
    """All workers by role; call `start()` in the running loop and `close()` at the end."""

    def __init__(self, config: GatewayConfig, include_block_hashes: bool = True,
                 on_worker_removed=None, on_worker_restarted=None) -> None:
        """on_worker_removed(address): it left or restarted (what was sent to it is gone);
        on_worker_restarted(role, address): a poll saw it with a new kv_epoch."""
        self.config = config
        self._include_hashes = include_block_hashes
        self._on_removed = on_worker_removed or (lambda address: None)
        self._on_restarted = on_worker_restarted or (lambda role, address: None)
        self.workers: dict[str, dict[str, Worker]] = {DECODE: {}, PREFILL: {}}
        self._resolved: dict[str, list[str]] = {}
        self._refresher: asyncio.Task | None = None
        self._read_stamp: tuple[int, ...] | None = None  # the workers file as last read
        self._background: set[asyncio.Task] = set()
        self._closed = False

    async def start(self) -> None:
        """Find the workers and wait for each one's first poll (at most one RPC timeout), so
        /health and routing are true from the first request on, not a poll later."""
        await self.refresh()
        polls = [asyncio.ensure_future(w.polled.wait())
                 for role in self.workers.values() for w in role.values()]
        if polls:
            await asyncio.wait(polls, timeout=self.config.rpc_timeout_s + 1.0)
            for t in polls:
                t.cancel()
        self._refresher = asyncio.create_task(self._refresh_loop(), name="worker-refresh")

    async def close(self) -> None:
        self._closed = True
        tasks = [t for t in [self._refresher] if t]
        for role in self.workers.values():
            for w in role.values():
                tasks.append(w.poller)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await asyncio.gather(*(w.channel.close() for r in self.workers.values()
                               for w in r.values()), return_exceptions=True)

    # ---- routing table -------------------------------------------------------------------
    def views(self, role: str) -> list[WorkerView]:
        now = time.monotonic()
        stale = self.config.router.stale_after_s
        return [w.view(now, stale) for w in self.workers[role].values()]

    def get(self, role: str, address: str) -> Worker | None:
        return self.workers[role].get(address)

    def num_healthy(self, role: str) -> int:
        return sum(w.healthy is True for w in self.workers[role].values())

    def block_size(self) -> int | None:
        """KV block size reported by any decode worker (None before the first stats)."""
        for w in self.workers[DECODE].values():
            if w.stats is not None and w.stats.kv_layout.block_size:
                return w.stats.kv_layout.block_size
        return None

    def kv_dtypes(self) -> dict[str, str]:
        """Worker address → the dtype of its KV (and weights): "float32", "bfloat16" or
        "float16", for the workers that reported stats."""
        return {w.address: common_pb2.KVDType.Name(w.stats.kv_layout.dtype)
                .removeprefix("KV_DTYPE_").lower()
                for role in (DECODE, PREFILL) for w in self.workers[role].values()
                if w.stats is not None and w.stats.kv_layout.dtype}

    def path_queue(self, role: str, address: str) -> PathQueue:
        """A worker's queue for SLO admission (gateway/admission.py): its prompt tokens
        queued by its fresh stats, less what its measured rate has computed since (0 when
        stale, missing or unknown), that rate (the last one reported, 0 = none), its running
        sequences, and what it runs with (its prefill chunk, a decode worker's P/D policy)."""
        w = self.workers[role].get(address)
        if w is None or w.stats is None:
            return PathQueue(address, 0)
        st = w.stats
        settings = dict(chunk_tokens=st.prefill_target_tokens)
        if st.HasField("pd_policy"):
            p = st.pd_policy
            settings["policy"] = PDPolicy.from_stats(p.itl_budget_ms, p.idle_budget_ms,
                                                     p.min_remote_tokens,
                                                     p.remote_stall_fraction)
        rate = st.prefill_tokens_per_s
        age = time.monotonic() - w.stats_at
        if age > self.config.router.stale_after_s:
            return PathQueue(address, 0, rate, **settings)
        return PathQueue(address, max(0, int(st.num_waiting_tokens - rate * age)), rate,
                         st.num_running, **settings)

    def mark_failed(self, role: str, address: str, error: str) -> None:
        w = self.workers[role].get(address)
        if w is not None:
            w.healthy, w.last_error = False, error

    # ---- discovery -----------------------------------------------------------------------
    async def refresh(self) -> None:
        """Re-read the workers file, re-resolve names, add and remove workers."""
        specs = {DECODE: list(self.config.decode), PREFILL: list(self.config.prefill)}
        if self.config.workers_file:
            self._read_stamp = _file_stamp(self.config.workers_file)  # before the read
            try:
                extra = read_workers_file(self.config.workers_file)
                for role in specs:
                    specs[role] += extra[role]
            except (OSError, ValueError) as e:
                logger.warning("workers file %s unreadable, keeping the last list: %s",
                               self.config.workers_file, e)
                return
        for role, role_specs in specs.items():
            wanted: list[str] = []
            for spec in dict.fromkeys(role_specs):
                try:
                    self._resolved[spec] = await resolve(spec)
                except OSError as e:  # keep the last answer through a DNS hiccup
                    logger.warning("cannot resolve %s: %s", spec, e)
                wanted += self._resolved.get(spec, [])
            self._sync(role, list(dict.fromkeys(wanted)))

    def _sync(self, role: str, addresses: list[str]) -> None:
        current = self.workers[role]
        for address in addresses:
            if address not in current:
                current[address] = self._connect(role, address)
                logger.info("%s worker added: %s", role, address)
        for address in [a for a in current if a not in addresses]:
            w = current.pop(address)
            logger.info("%s worker removed: %s", role, address)
            self._on_removed(address)
            if w.poller:
                w.poller.cancel()
            task = asyncio.create_task(self._close_when_idle(w))
            self._background.add(task)
            task.add_done_callback(self._background.discard)

    def _connect(self, role: str, address: str) -> Worker:
        channel = grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
        stub_cls = (decode_pb2_grpc.DecodeServiceStub if role == DECODE
                    else prefill_pb2_grpc.PrefillServiceStub)
        w = Worker(address, role, channel, stub_cls(channel), health_pb2_grpc.HealthStub(channel))
        w.poller = asyncio.create_task(self._poll_loop(w), name=f"poll-{address}")
        return w

    async def _close_when_idle(self, w: Worker, limit_s: float = 600.0) -> None:
        deadline = time.monotonic() + limit_s
        while w.inflight and time.monotonic() < deadline:
            await asyncio.sleep(0.5)
        await w.channel.close()

    async def _refresh_loop(self) -> None:
        """Refresh every dns_refresh_s, and within FILE_CHECK_S of a change to the workers
        file (`_file_stamp`: `baton up` writes its workers' addresses there once they are
        up, so the gateway starts beside them rather than after them); without a workers
        file, every dns_refresh_s only."""
        due = time.monotonic() + self.config.dns_refresh_s
        check_s = min(FILE_CHECK_S, self.config.dns_refresh_s) if self.config.workers_file \
            else self.config.dns_refresh_s
        while not self._closed:
            await asyncio.sleep(check_s)
            if time.monotonic() < due and \
                    _file_stamp(self.config.workers_file) == self._read_stamp:
                continue
            due = time.monotonic() + self.config.dns_refresh_s
            try:
                await self.refresh()
            except Exception:  # never let discovery die
                logger.exception("worker refresh failed")

    # ---- polling -------------------------------------------------------------------------
    async def _poll_loop(self, w: Worker) -> None:
        while not self._closed:
            await self.poll_once(w)
            w.polled.set()
            await asyncio.sleep(self.config.poll_interval_s)

    async def poll_once(self, w: Worker) -> None:
        """One health check and GetStats of `w`; a new kv_epoch drops what we knew of it."""
        timeout = self.config.rpc_timeout_s
        req = common_pb2.GetStatsRequest(include_block_hashes=self._include_hashes)
        health, stats = await asyncio.gather(
            w.health.Check(health_pb2.HealthCheckRequest(service=""), timeout=timeout),
            w.stub.GetStats(req, timeout=timeout), return_exceptions=True)
        if not isinstance(stats, BaseException):
            old_epoch = w.kv_epoch
            if apply_stats(w, stats, time.monotonic()):
                logger.warning("%s worker %s restarted (kv_epoch %016x, was %016x): what it "
                               "held and what was sent to it are forgotten", w.role, w.address,
                               stats.kv_epoch, old_epoch)
                self._on_removed(w.address)  # its cache and our sent index are gone
                self._on_restarted(w.role, w.address)
        # The health service decides; failed stats only go stale (the router then ignores
        # them). Without a health service, answering GetStats is the proof of life.
        if isinstance(health, grpc.aio.AioRpcError) and \
                health.code() == grpc.StatusCode.UNIMPLEMENTED:
            if isinstance(stats, BaseException):
                self._poll_failed(w, f"GetStats: {_describe(stats)}")
                return
            serving = True
        elif _timed_out(health) and w.slow_polls + 1 < SLOW_POLLS_TO_UNHEALTHY:
            w.slow_polls += 1  # busy (a long step holds its loop), not gone: not yet
            return
        elif isinstance(health, BaseException):
            self._poll_failed(w, f"health: {_describe(health)}")
            return
        else:
            serving = health.status == health_pb2.HealthCheckResponse.SERVING
        if w.healthy is not serving:
            logger.info("%s worker %s is %s", w.role, w.address,
                        "healthy" if serving else "not serving")
        w.healthy, w.slow_polls = serving, 0
        w.last_error = "" if serving else "health: NOT_SERVING"

    def _poll_failed(self, w: Worker, error: str) -> None:
        if w.healthy is not False:
            logger.warning("%s worker %s unhealthy: %s", w.role, w.address, error)
        w.healthy, w.last_error = False, error


def _timed_out(e: object) -> bool:
    return isinstance(e, grpc.aio.AioRpcError) and e.code() == grpc.StatusCode.DEADLINE_EXCEEDED


def _describe(e: BaseException) -> str:
    if isinstance(e, grpc.aio.AioRpcError):
        return f"{e.code().name} {e.details() or ''}".strip()
    return f"{type(e).__name__}: {e}"
