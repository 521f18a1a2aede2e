"""In-process prefill/decode servers on 127.0.0.1 port 0, and a small Generate client."""
from __future__ import annotations

import asyncio
import itertools
from dataclasses import dataclass, field

import grpc

from baton.config import CacheConfig, EngineConfig, SchedulerConfig
from baton.sampling_params import SamplingParams
from baton.worker.flags import ServerConfig
from baton.worker.wire import sampling_params_to_proto
from decode_service.config import DecodeConfig
from decode_service.server import DecodeServer
from prefill_service.config import PrefillConfig
from prefill_service.server import PrefillServer
from protos import common_pb2, decode_pb2, decode_pb2_grpc, prefill_pb2_grpc

BLOCK = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
# Tests of the remote path say so at the call: with the production P/D cost model (no
# --min-remote-tokens) a tiny model's short test prompts would all be prefilled locally.
FORCE_REMOTE = {"min_remote_tokens": 16}
_ids = itertools.count()


def engine_config(model, block_size: int = BLOCK, num_blocks: int = 96, **sched) -> EngineConfig:
    """The service tests' engine: a small pool, production scheduling, and float32 (named:
    their outputs are compared token for token with transformers in float32)."""
    return EngineConfig(model=str(model), dtype="float32",
                        cache=CacheConfig(block_size=block_size, num_blocks=num_blocks),
                        scheduler=SchedulerConfig(**sched))


def prefill_config(model, transport: str, engine: EngineConfig | None = None,
                   **kw) -> PrefillConfig:
    return PrefillConfig(engine=engine or engine_config(model), server=ServerConfig(port=0),
                         transport=transport, **kw)


def decode_config(model, transport: str, prefill_address: str | None,
                  engine: EngineConfig | None = None, **kw) -> DecodeConfig:
    return DecodeConfig(engine=engine or engine_config(model), server=ServerConfig(port=0),
                        transport=transport, prefill_address=prefill_address, **kw)


async def start_prefill(model, transport: str, **kw) -> PrefillServer:
    return await PrefillServer(prefill_config(model, transport, **kw)).start()


async def start_decode(model, transport: str, prefill_address: str | None,
                       **kw) -> DecodeServer:
    return await DecodeServer(decode_config(model, transport, prefill_address, **kw)).start()


async def start_pair(model, transport: str, engine: EngineConfig | None = None, **decode_kw):
    """(prefill server, decode server, client) on one transport, both with `engine`'s config
    (default: `engine_config(model)`); `decode_kw`: more of the decode worker's config."""
    prefill = await start_prefill(model, transport, engine=engine)
    decode = await start_decode(model, transport, prefill.address, engine=engine, **decode_kw)
    return prefill, decode, Client(decode.address, prefill.address)


async def stop_pair(prefill, decode, client) -> None:
    await client.close()
    await decode.stop(drain_s=0)
    await prefill.stop(drain_s=0)


@dataclass
class Result:
    tokens: dict[int, list[int]] = field(default_factory=dict)
    text: dict[int, str] = field(default_factory=dict)
    finished: dict[int, decode_pb2.Finished] = field(default_factory=dict)
    chunks: list[decode_pb2.TokenChunk] = field(default_factory=list)

    @property
    def output(self) -> list[int]:
        return self.tokens.get(0, [])

    @property
    def fin(self) -> decode_pb2.Finished:
        return self.finished[0]


def request(prompt, params: SamplingParams = GREEDY, rid: str | None = None,
            **kw) -> decode_pb2.GenerateRequest:
    return decode_pb2.GenerateRequest(
        request_id=rid or f"req-{next(_ids)}", prompt_token_ids=prompt,
        sampling_params=sampling_params_to_proto(params), **kw)


async def collect(call) -> Result:
    res = Result()
    async for msg in call:
        if msg.HasField("tokens"):
            c = msg.tokens
            res.chunks.append(c)
            res.tokens.setdefault(c.index, []).extend(c.token_ids)
            res.text[c.index] = res.text.get(c.index, "") + c.text_delta
        else:
            res.finished[msg.finished.index] = msg.finished
    return res


class Client:
    """Stubs for one decode (and optionally one prefill) server."""

    def __init__(self, decode_address: str, prefill_address: str | None = None) -> None:
        self.channel = grpc.aio.insecure_channel(decode_address)
        self.decode = decode_pb2_grpc.DecodeServiceStub(self.channel)
        self.pchannel = grpc.aio.insecure_channel(prefill_address) if prefill_address else None
        self.prefill = prefill_pb2_grpc.PrefillServiceStub(self.pchannel) if self.pchannel \
            else None

    async def generate(self, prompt, params: SamplingParams = GREEDY, timeout: float = 60,
                       **kw) -> Result:
        return await collect(self.decode.Generate(request(prompt, params, **kw),
                                                  timeout=timeout))

    async def stats(self, stub=None) -> common_pb2.WorkerStats:
        stub = stub or self.decode
        return await stub.GetStats(common_pb2.GetStatsRequest(include_block_hashes=True),
                                   timeout=10)

    async def close(self) -> None:
        await self.channel.close()
        if self.pchannel is not None:
            await self.pchannel.close()


class Cluster:
    """Prefill and decode servers started per test (configs differ per test), and clients;
    close() stops them all."""

    def __init__(self) -> None:
        self.servers, self.clients = [], []

    async def prefill(self, model, transport, **kw) -> PrefillServer:
        self.servers.append(await start_prefill(model, transport, **kw))
        return self.servers[-1]

    async def decode(self, model, transport, address, **kw) -> DecodeServer:
        self.servers.append(await start_decode(model, transport, address, **kw))
        return self.servers[-1]

    def client(self, decode, prefill=None) -> Client:
        self.clients.append(Client(decode.address, prefill.address if prefill else None))
        return self.clients[-1]

    async def close(self) -> None:
        for c in self.clients:
            await c.close()
        for s in reversed(self.servers):
            await s.stop(drain_s=0)


async def pools_whole(*servers, timeout: float = 10.0) -> None:
    """Wait until every server's KV pool has all blocks free and no request is held."""
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        # held blocks (prefill leases, decode holds) are referenced: not free
        states = [(s.engine.counts().num_free_blocks, s.engine.num_blocks,
                   s.engine.num_unfinished_requests) for s in servers]
        if all(free == total and not live for free, total, live in states):
            return
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"pools not whole: (free, total, requests) = {states}")
        await asyncio.sleep(0.02)
