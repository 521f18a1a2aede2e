"""One Generate request on the decode worker: its prompt, its SamplingParams, its abort event
and its n sequences (sequence.py), made one by one (sequence 0 first: the others hit the
prompt blocks it puts in the prefix cache).

    job = Job(request_id, prompt, params)
    seq = job.new_sequence(engine, remote_kv, ctx)   seq_id "request_id" (n = 1) or
                                                     "request_id/index"; its own seed
    job.abort()                                      every sequence stops where it is
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field, replace

from baton.engine.remote_kv import RemoteKV
from baton.sampling_params import SamplingParams
from baton.session_hints import SessionHint
from baton.worker.async_engine import AsyncEngine
from baton.worker.wire import seed_for_index
from decode_service.context import DecodeContext
from decode_service.sequence import DecodeSequence


@dataclass(eq=False)
class Job:
    request_id: str
    prompt: list[int]
    params: SamplingParams
    arrival: float = field(default_factory=time.monotonic)
    aborted: asyncio.Event = field(default_factory=asyncio.Event)
    sequences: list[DecodeSequence] = field(default_factory=list)
    session: SessionHint | None = None

    @property
    def n(self) -> int:
        return self.params.n

    def abort(self) -> None:
        self.aborted.set()

    def new_sequence(self, engine: AsyncEngine, remote_kv: RemoteKV,
                     ctx: DecodeContext) -> DecodeSequence:
        index = len(self.sequences)
        seq_id = self.request_id if self.n == 1 else f"{self.request_id}/{index}"
        params = replace(self.params, n=1, seed=seed_for_index(self.params.seed, index))
        seq = DecodeSequence(index, seq_id, self.prompt, params, self.aborted, engine,
                             remote_kv, ctx, self.session)
        self.sequences.append(seq)
        return seq
