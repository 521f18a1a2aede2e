"""Engine outputs → the Generate stream's messages, with TTFT/ITL, usage and timings.

    StepOutput(index i, new tokens, text) ──add()──▶ TokenChunk{index i, token_ids, text}
    StepOutput(finished)                  ──add()──▶ kept until every completion is done
    finish() ──▶ Finished{index, reason, stop_reason, usage (the request's), timings} × n
"""
from __future__ import annotations

import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

from baton.outputs import StepOutput
from baton.worker.wire import FINISH_REASONS, logprob_to_proto
from decode_service.metrics import DecodeMetrics
from protos import common_pb2, decode_pb2

if TYPE_CHECKING:
    from decode_service.worker import Job


class ResponseBuilder:
    def __init__(self, job: Job, metrics: DecodeMetrics) -> None:
        self.job, self.metrics = job, metrics
        self.finals: dict[int, StepOutput] = {}
        self.last_token_time: dict[int, float] = {}
        self.first_token_time: float | None = None

    def add(self, index: int, out: StepOutput) -> Iterator[decode_pb2.GenerateResponse]:
        if out.new_token_ids or out.text_delta:
            self._tokens_seen(index, len(out.new_token_ids))
            yield decode_pb2.GenerateResponse(tokens=decode_pb2.TokenChunk(
                index=index, token_ids=out.new_token_ids, text_delta=out.text_delta,
                logprobs=[logprob_to_proto(lp) for lp in out.logprobs]))
        if out.finished:
            self.finals[index] = out
            self.metrics.requests.labels(out.finish_reason or "unknown").inc()

    def finish(self) -> Iterator[decode_pb2.GenerateResponse]:
        job = self.job
        usage = common_pb2.Usage(
            prompt_tokens=len(job.prompt),
            completion_tokens=sum(o.num_output_tokens for o in self.finals.values()),
            cached_tokens=job.completions[0].cached_tokens)
        self.metrics.cache_hit_tokens.inc(job.completions[0].decode_cached_tokens)
        timings = self._timings()
        for index in sorted(self.finals):
            out = self.finals[index]
            fin = decode_pb2.Finished(
                index=index, usage=usage, timings=timings, error=out.error or "",
                finish_reason=FINISH_REASONS.get(out.finish_reason,
                                                 common_pb2.FINISH_REASON_ERROR))
            if isinstance(out.stop_reason, str):
                fin.stop_str = out.stop_reason
            elif isinstance(out.stop_reason, int):
                fin.stop_token_id = out.stop_reason
            yield decode_pb2.GenerateResponse(finished=fin)

    def _tokens_seen(self, index: int, num_tokens: int) -> None:
        now = time.monotonic()
        if self.first_token_time is None:
            self.first_token_time = now
            self.metrics.ttft.observe(now - self.job.arrival)
        last = self.last_token_time.get(index)
        if last is not None and num_tokens:
            self.metrics.itl.observe((now - last) / num_tokens)
        if num_tokens:
            self.last_token_time[index] = now

    def _timings(self) -> decode_pb2.RequestTimings:
        job, c = self.job, self.job.completions[0]
        t = decode_pb2.RequestTimings()
        if self.first_token_time is not None:
            t.ttft_seconds = self.first_token_time - job.arrival
        if c.remote is not None and c.remote.ok:
            resp = c.remote.response
            t.remote_prefill = True
            t.queue_seconds, t.prefill_seconds = resp.queue_seconds, resp.compute_seconds
            t.transfer_seconds = resp.transfer_seconds + c.remote.arrival_seconds
        elif c.engine_request is not None and c.engine_request.scheduled_time is not None:
            scheduled = c.engine_request.scheduled_time
            t.queue_seconds = max(0.0, scheduled - job.arrival)
            if self.first_token_time is not None:
                t.prefill_seconds = max(0.0, self.first_token_time - scheduled)
        return t
