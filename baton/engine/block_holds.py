"""Prefill role: a finished prompt's blocks stay referenced until they are sent and released.

    holds = BlockHolds(engine)
    holds.add(rid, prompt, params(max_tokens=1))   the engine prefills and samples as usual
      ... first token out, request FINISHED: its blocks are *held*, not freed
    holds.block_table(rid)                         the blocks to send to the decode worker
    holds.release(rid)                             to the prefix cache (the next turn hits)
    holds.abort(rid)                               any state, held or not: blocks freed
    ids, pins = holds.pin(rid, start, stop)        one more reference on blocks a transfer
    holds.unpin(pins)                              reads while the prompt is still prefilled

A prompt whose first tokens the decode worker holds (PrefillRequest.src_block_ids) and this
engine lacks is added with `add_pulling`: it waits (WAITING_FOR_REMOTE_KV, blocks allocated)
while the worker reads those blocks from the decode worker; `pulled` then caches them (they
are the prompt's KV, as if computed here) and runs the rest:

    own hit 1 block, decode holds 3:   [ own ][ pull ][ pull ][ compute ... ]
                                               └─ PrefixPull.dst_block_ids

Only requests added here are held, and only when they finish normally (stop or length); an
aborted or failed request frees its blocks at once.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

from baton.engine.kv_cache import Block
from baton.engine.kv_source import KVSource
from baton.engine.request import Request, RequestStatus
from baton.outputs import StepOutput
from baton.sampling_params import SamplingParams
from baton.session_hints import SessionHint

if TYPE_CHECKING:
    from baton.engine.llm_engine import LLMEngine


class PrefixPull(NamedTuple):
    """The blocks to read a peer's prefix into: this request's blocks [first_block, ...)
    for prompt tokens [first_block * block_size, num_tokens)."""

    first_block: int
    dst_block_ids: list[int]
    num_tokens: int


class BlockHolds:
    """The held requests of one engine (engine thread only). Installs the engine's
    finish hook; build at most one per engine."""

    def __init__(self, engine: LLMEngine) -> None:
        if engine.finish_hook is not None:
            raise ValueError("this engine already has a finish hook")
        self.engine = engine
        self._adding: set[str] = set()
        self._held: dict[str, Request] = {}
        engine.finish_hook = self._on_finish

    def add(self, request_id: str, prompt_token_ids: list[int],
            params: SamplingParams, session: SessionHint | None = None) -> Request:
        """Queue a request whose blocks are held once it finishes (then released into
        `session`'s free list). Raises ValueError like `LLMEngine.add_request`."""
        req = self.engine.add_request(request_id, prompt_token_ids, params, session)
        self._adding.add(request_id)
        return req

    def add_pulling(self, request_id: str, prompt_token_ids: list[int],
                    params: SamplingParams, session: SessionHint | None,
                    peer_tokens: int) -> tuple[Request, PrefixPull | None]:
        """As `add`, for a prompt whose first `peer_tokens` (block aligned, below its length)
        another worker holds: when this engine's own prefix hit is shorter and the pool holds
        the whole prompt now, the request waits with its blocks allocated and the PrefixPull
        names those to read the peer's tokens into (`pulled` ends the wait); else it is
        queued as by `add` (None: it computes what it lacks). Raises ValueError like
        `LLMEngine.add_request`."""
        e, kv = self.engine, self.engine.kv
        req = e.new_request(request_id, prompt_token_ids, params, session)
        hits, num_cached = kv.get_computed_blocks(request_id, req.prompt_token_ids)
        pull = None
        if num_cached < peer_tokens and \
                kv.allocate_slots(request_id, req.num_prompt_tokens, hits) is not None:
            e.scheduler.wait_for_remote_kv(req, num_cached)
            first = num_cached // kv.block_size
            table = kv.block_table(request_id)[first:peer_tokens // kv.block_size]
            pull = PrefixPull(first, table, peer_tokens)
        else:
            e.scheduler.add(req)
        self._adding.add(request_id)
        return req, pull

    def pulled(self, request_id: str, pull: PrefixPull, ok: bool) -> None:
        """A pull ended. ok: its blocks hold the peer's KV: they are cached and counted as
        cached (KVSource.PEER), and the request computes from `pull.num_tokens`; else it
        computes them too. KeyError if the request is not waiting for a pull."""
        e = self.engine
        req = e.requests[request_id].request
        if req.status != RequestStatus.WAITING_FOR_REMOTE_KV:
            raise KeyError(f"request {request_id!r} is not waiting for a pull")
        if not ok:
            e.scheduler.remote_kv_ready(req, req.num_cached_tokens)
            return
        e.kv.cache_blocks(request_id, req.prompt_token_ids, pull.num_tokens)
        req.cached_spans += ((KVSource.PEER, pull.num_tokens - req.num_cached_tokens),)
        req.num_cached_tokens = pull.num_tokens
        e.scheduler.remote_kv_ready(req, pull.num_tokens)

    def _on_finish(self, req: Request, status: RequestStatus) -> bool:
        rid = req.request_id
        if rid not in self._adding:
            return False
        self._adding.discard(rid)
        if status > RequestStatus.FINISHED_LENGTH:
            return False
        self._held[rid] = req
        return True

    def block_table(self, request_id: str) -> list[int]:
        """Block ids of a held request. Raises KeyError if it holds none."""
        if request_id not in self._held:
            raise KeyError(f"no held blocks for {request_id!r}")
        return self.engine.kv.block_table(request_id)

    def release(self, request_id: str) -> bool:
        """End a hold (blocks to the prefix cache). False if nothing was held."""
        if self._held.pop(request_id, None) is None:
            return False
        self.engine.kv.free(request_id)
        return True

    def abort(self, request_id: str) -> StepOutput | None:
        """Abort in any state, held included (blocks freed). Returns the final output of a
        request still in the engine, else None."""
        self._adding.discard(request_id)
        out = self.engine.abort_request(request_id)
        self.release(request_id)
        return out

    def pin(self, request_id: str, start: int, stop: int) -> tuple[list[int], list[Block]]:
        """Reference blocks [start, stop) of a request's block table once more, so neither
        preemption nor an abort frees them while a transfer reads them (a prompt still being
        prefilled sends its full blocks early; a plain extra ref_cnt, not a session pin).
        Returns (their ids, the blocks for `unpin`).
        Raises KeyError when the request has no blocks now."""
        blocks = self.engine.kv.requests[request_id].blocks[start:stop]
        self.engine.kv.pool.touch(blocks)
        return [b.block_id for b in blocks], list(blocks)

    def unpin(self, blocks: list[Block]) -> None:
        """Drop the references `pin` took (blocks no one else holds go to the free queue)."""
        self.engine.kv.release_detached(blocks)

    def __len__(self) -> int:
        return len(self._held)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._held
