"""A fake decode worker for gateway tests and the overhead benchmark (no model, no KV).

It serves DecodeService (Generate streams canned tokens, honouring n, max_tokens, stop strings
and logprobs; GetStats reports a settable load and block hashes) and the gRPC health service.
`Behavior` makes it slow, hang, pause mid-stream until released, reject, fail mid-stream or
end with an error; every request
and every cancellation is recorded so tests can assert on them.
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from baton.json_schema import FIELD_METADATA
from protos import common_pb2, decode_pb2, decode_pb2_grpc, prefill_pb2_grpc

DEFAULT_TOKENS = ((11, "Hello"), (12, " world"), (13, "!"))


@dataclass
class Behavior:
    tokens: tuple[tuple[int, str], ...] = DEFAULT_TOKENS
    first_delay_s: float = 0.0
    token_delay_s: float = 0.0
    fail_after: int | None = None        # abort(UNAVAILABLE) after this many token steps
    reject: grpc.StatusCode | None = None  # abort before any message
    reject_field: str | None = None      # ... naming this request field (trailing metadata)
    hang: bool = False                   # accept and never answer
    finish_error: str | None = None      # Finished{ERROR} after the tokens
    cached_tokens: int = 0
    pause_after: int | None = None       # after this many token steps wait for `resume`
    resume: asyncio.Event | None = None  # (same event loop: the tests run the fake in-process)


@dataclass
class FakeDecode(decode_pb2_grpc.DecodeServiceServicer):
    behavior: Behavior = field(default_factory=Behavior)
    worker_id: str = "fake"
    load: float = 0.0
    block_size: int = 4
    block_hashes: list[int] = field(default_factory=list)
    kv_epoch: int = 1
    fail_stats: bool = False
    requests: list = field(default_factory=list)
    cancelled: list[str] = field(default_factory=list)
    completed: list[str] = field(default_factory=list)
    stats_calls: int = 0
    metrics_port: int = 0  # reported in GetStats (WorkerStats.metrics_port)
    num_waiting_tokens: int = 0  # reported in GetStats: the queue SLO admission predicts from
    ended_sessions: list[str] = field(default_factory=list)  # EndSession calls, in order

    async def Generate(self, request, context):
        self.requests.append(request)
        b = self.behavior
        try:
            if b.reject is not None:
                field = ((FIELD_METADATA, b.reject_field),) if b.reject_field else ()
                await context.abort(b.reject, "rejected by the fake worker",
                                    trailing_metadata=field)
            if b.hang:
                await asyncio.sleep(3600)
            if b.first_delay_s:
                await asyncio.sleep(b.first_delay_s)
            async for msg in self._tokens(request, b, context):
                yield msg
            self.completed.append(request.request_id)
        except (asyncio.CancelledError, GeneratorExit):  # cancelled at an await or a yield
            self.cancelled.append(request.request_id)
            raise

    async def _tokens(self, request, b: Behavior, context):
        sp = request.sampling_params
        n = max(1, sp.n)
        limit = sp.max_tokens if sp.HasField("max_tokens") else len(b.tokens)
        texts, done, emitted = [""] * n, [False] * n, 0
        stops = list(sp.stop)
        for step, (tid, piece) in enumerate(b.tokens[:limit]):
            if b.pause_after is not None and step == b.pause_after:
                await b.resume.wait()
            if b.fail_after is not None and step >= b.fail_after:
                await context.abort(grpc.StatusCode.UNAVAILABLE, "fake worker died")
            for i in range(n):
                if done[i]:
                    continue
                prev = texts[i]
                texts[i] += piece
                hit = next((s for s in stops if s in texts[i]), None)
                delta = piece if hit is None else \
                    texts[i][len(prev):max(len(prev), texts[i].index(hit))]
                emitted += 1
                msg = _chunk(i, tid + i, delta, sp)
                if step == 0 and sp.HasField("prompt_logprobs"):  # each one's first chunk
                    msg.tokens.prompt_logprobs.extend(prompt_logprobs(
                        list(request.prompt_token_ids), sp.prompt_logprobs))
                if i == 0 and step == 0:  # as the real worker: the prompt's usage, at once
                    msg.tokens.prompt_usage.CopyFrom(common_pb2.Usage(
                        prompt_tokens=len(request.prompt_token_ids),
                        cached_tokens=b.cached_tokens))
                yield msg
                if hit is not None:
                    done[i] = True
                    yield _finished(i, common_pb2.FINISH_REASON_STOP, stop_str=hit)
            if b.token_delay_s:
                await asyncio.sleep(b.token_delay_s)
        usage = common_pb2.Usage(prompt_tokens=len(request.prompt_token_ids),
                                 completion_tokens=emitted, cached_tokens=b.cached_tokens)
        reason = common_pb2.FINISH_REASON_LENGTH if limit < len(b.tokens) \
            else common_pb2.FINISH_REASON_STOP
        for i in range(n):
            if b.finish_error:
                yield _finished(i, common_pb2.FINISH_REASON_ERROR, usage, error=b.finish_error)
            elif not done[i]:
                yield _finished(i, reason, usage)

    async def Abort(self, request, context):
        return common_pb2.AbortResponse(found=False)

    async def EndSession(self, request, context):
        self.ended_sessions.append(request.session_id)
        return common_pb2.EndSessionResponse(num_blocks=3)

    async def GetStats(self, request, context):
        self.stats_calls += 1
        if self.fail_stats:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "stats unavailable")
        stats = common_pb2.WorkerStats(
            role=common_pb2.WORKER_ROLE_DECODE, worker_id=self.worker_id, load=self.load,
            num_total_blocks=100, num_free_blocks=100,
            kv_layout=common_pb2.KVLayout(model="fake", block_size=self.block_size,
                                          dtype=common_pb2.KV_DTYPE_FLOAT32),
            kv_epoch=self.kv_epoch, metrics_port=self.metrics_port,
            num_waiting_tokens=self.num_waiting_tokens)
        if request.include_block_hashes:
            stats.snapshot.block_hashes.extend(self.block_hashes)
        return stats


def _chunk(index: int, token_id: int, text: str, sp) -> decode_pb2.GenerateResponse:
    chunk = decode_pb2.TokenChunk(index=index, token_ids=[token_id], text_delta=text)
    if sp.HasField("logprobs"):
        chunk.logprobs.append(common_pb2.TokenLogprobs(
            token_id=token_id, logprob=-0.5, rank=1,
            top=[common_pb2.TopLogprob(token_id=token_id + k, logprob=-0.5 - k)
                 for k in range(sp.logprobs)]))
    return decode_pb2.GenerateResponse(tokens=chunk)


def prompt_logprobs(prompt: list[int], k: int) -> list[common_pb2.TokenLogprobs]:
    """The fake's prompt logprobs: token p (p >= 1) gets -p / 10, rank p, top k of
    ids 100 + j at -j / 10."""
    return [common_pb2.TokenLogprobs(
        token_id=t, logprob=-p / 10, rank=p,
        top=[common_pb2.TopLogprob(token_id=100 + j, logprob=-j / 10) for j in range(k)])
        for p, t in enumerate(prompt) if p]


def _finished(index: int, reason, usage=None, stop_str=None, error=""):
    f = decode_pb2.Finished(index=index, finish_reason=reason, error=error)
    if usage is not None:
        f.usage.CopyFrom(usage)
    if stop_str is not None:
        f.stop_str = stop_str
    return decode_pb2.GenerateResponse(finished=f)


class FakeWorker:
    """A running fake: `await FakeWorker.start()`, `.address`, `.servicer`, `await .stop()`."""

    def __init__(self, servicer: FakeDecode, server, health_servicer, port: int) -> None:
        self.servicer = servicer
        self.server = server
        self.health = health_servicer
        self.address = f"127.0.0.1:{port}"

    @classmethod
    async def start(cls, behavior: Behavior | None = None, **kwargs) -> FakeWorker:
        servicer = FakeDecode(behavior or Behavior(), **kwargs)
        return await cls.serve(servicer, decode_pb2_grpc.add_DecodeServiceServicer_to_server)

    @classmethod
    async def serve(cls, servicer, add_to_server) -> FakeWorker:
        """Serve `servicer` (and SERVING health) on a free 127.0.0.1 port."""
        server = grpc.aio.server()
        add_to_server(servicer, server)
        health_servicer = health.aio.HealthServicer()
        await health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        return cls(servicer, server, health_servicer, port)

    async def set_serving(self, serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving \
            else health_pb2.HealthCheckResponse.NOT_SERVING
        await self.health.set("", status)

    async def stop(self, grace: float | None = None) -> None:
        await self.server.stop(grace)


class FakePrefill(prefill_pb2_grpc.PrefillServiceServicer):
    """Only what the gateway calls on a prefill worker: GetStats (and health)."""

    def __init__(self, load: float = 0.0, num_waiting_tokens: int = 0) -> None:
        self.load, self.num_waiting_tokens = load, num_waiting_tokens
        self.block_hashes: list[int] = []
        self.ended_sessions: list[str] = []

    async def EndSession(self, request, context):
        self.ended_sessions.append(request.session_id)
        return common_pb2.EndSessionResponse(num_blocks=2)

    async def GetStats(self, request, context):
        stats = common_pb2.WorkerStats(role=common_pb2.WORKER_ROLE_PREFILL, load=self.load,
                                       kv_epoch=7, num_waiting_tokens=self.num_waiting_tokens)
        if request.include_block_hashes:
            stats.snapshot.block_hashes.extend(self.block_hashes)
        return stats


async def start_fake_prefill(load: float = 0.0, num_waiting_tokens: int = 0) -> FakeWorker:
    return await FakeWorker.serve(FakePrefill(load, num_waiting_tokens),
                                  prefill_pb2_grpc.add_PrefillServiceServicer_to_server)


async def _serve(tokens: int, token_delay_s: float) -> None:
    worker = await FakeWorker.start(Behavior(tokens=tuple((100 + i, f" t{i}")
                                                          for i in range(tokens)),
                                             token_delay_s=token_delay_s))
    print(worker.address, flush=True)
    await asyncio.Event().wait()


if __name__ == "__main__":  # python -m tests.gateway.fake_decode: prints its address, serves
    import argparse

    import uvloop

    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=4, help="tokens per completion")
    p.add_argument("--token-delay-s", type=float, default=0.0, help="pause after each token")
    a = p.parse_args()
    uvloop.run(_serve(a.tokens, a.token_delay_s))
