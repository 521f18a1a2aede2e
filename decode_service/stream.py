"""Engine outputs → the Generate stream's messages, with TTFT/ITL, usage and timings.

    merge_outputs(job.sequences) ──▶ (index i, StepOutput) as they come, any sequence
    StepOutput(index i, new tokens, text) ──add()──▶ TokenChunk{index i, token_ids, text}
                                                      (completion 0's first: + prompt_usage;
                                                      each one's first: + prompt_logprobs)
    StepOutput(finished)                  ──add()──▶ kept until every sequence is done
    finish() ──▶ Finished{index, reason, stop_reason, usage (the request's), timings} × n

Usage: prompt_tokens = len(prompt); completion_tokens = sum over sequences;
cached_tokens = prompt tokens nobody computed for sequence 0: the prefill worker's own
prefix hit when it prefilled remotely (it computes whatever it lacks, even blocks this worker
holds; those are simply not transferred), else this worker's prefix hit; cached_by splits
it by source and recomputed_held_tokens counts what prefill computed although this worker
held it (decode_service/usage.py). Both go to the metrics too. The prompt's part of it is
known once the prompt is prefilled: completion 0's first chunk carries it (prompt_usage), so
the gateway can state the cache split at the start of a stream (Anthropic's message_start).
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator

from baton.outputs import StepOutput
from baton.worker.wire import FINISH_REASONS, logprob_to_proto
from decode_service.job import Job
from decode_service.metrics import DecodeMetrics
from decode_service.sequence import DecodeSequence
from protos import common_pb2, decode_pb2


async def merge_outputs(sequences: list[DecodeSequence]
                        ) -> AsyncIterator[tuple[int, StepOutput]]:
    """Interleave the sequences' outputs as they come; leaving early aborts them."""
    if len(sequences) == 1:
        async for out in sequences[0].outputs():
            yield 0, out
        return
    shared: asyncio.Queue = asyncio.Queue()

    async def pump(seq: DecodeSequence) -> None:
        try:
            async for out in seq.outputs():
                shared.put_nowait((seq.index, out))
        finally:
            shared.put_nowait((seq.index, None))

    tasks = [asyncio.create_task(pump(seq)) for seq in sequences]
    try:
        for _ in range(len(tasks)):
            while (item := await shared.get())[1] is not None:
                yield item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


class ResponseBuilder:
    def __init__(self, job: Job, metrics: DecodeMetrics) -> None:
        self.job, self.metrics = job, metrics
        self.finals: dict[int, StepOutput] = {}
        self.last_token_time: dict[int, float] = {}
        self.first_token_time: float | None = None
        self.prompt_usage_sent = False

    def add(self, index: int, out: StepOutput) -> Iterator[decode_pb2.GenerateResponse]:
        """The messages of one sequence's output: its TokenChunk (completion 0's first one
        with the prompt's usage), if it has tokens; a finished output is kept for finish()."""
        if out.new_token_ids or out.text_delta:
            self._tokens_seen(index, len(out.new_token_ids))
            chunk = decode_pb2.TokenChunk(
                index=index, token_ids=out.new_token_ids, text_delta=out.text_delta,
                logprobs=[logprob_to_proto(lp) for lp in out.logprobs],
                prompt_logprobs=[logprob_to_proto(lp) for lp in out.prompt_logprobs or ()])
            if index == 0 and not self.prompt_usage_sent:
                self.prompt_usage_sent = True
                chunk.prompt_usage.CopyFrom(
                    self.job.sequences[0].usage.to_proto(len(self.job.prompt), 0))
            yield decode_pb2.GenerateResponse(tokens=chunk)
        if out.finished:
            self.finals[index] = out
            self.metrics.requests.labels(out.finish_reason or "unknown").inc()

    def finish(self) -> Iterator[decode_pb2.GenerateResponse]:
        """One Finished per completion, each with the request's usage and timings."""
        job = self.job
        split = job.sequences[0].usage
        usage = split.to_proto(len(job.prompt),
                               sum(o.num_output_tokens for o in self.finals.values()))
        self.metrics.cache_hit_tokens.inc(job.sequences[0].decode_cached_tokens)
        self.metrics.count_usage(split)
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
            self.metrics.observe_first_token(now - self.job.arrival)
        last = self.last_token_time.get(index)
        if last is not None and num_tokens:
            self.metrics.observe_tokens((now - last) / num_tokens, num_tokens)
        if num_tokens:
            self.last_token_time[index] = now

    def _timings(self) -> decode_pb2.RequestTimings:
        job, seq = self.job, self.job.sequences[0]
        t = decode_pb2.RequestTimings()
        if self.first_token_time is not None:
            t.ttft_seconds = self.first_token_time - job.arrival
        if seq.remote is not None and seq.remote.ok:
            resp = seq.remote.response
            t.remote_prefill = True
            t.queue_seconds, t.prefill_seconds = resp.queue_seconds, resp.compute_seconds
            t.transfer_seconds = resp.transfer_seconds + seq.remote.arrival_seconds
        elif seq.engine_request is not None and seq.engine_request.scheduled_time is not None:
            scheduled = seq.engine_request.scheduled_time
            t.queue_seconds = max(0.0, scheduled - job.arrival)
            if self.first_token_time is not None:
                t.prefill_seconds = max(0.0, self.first_token_time - scheduled)
        return t
