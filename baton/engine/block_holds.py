"""Prefill role: a finished prompt's blocks stay referenced until they are sent and released.

    holds = BlockHolds(engine)
    holds.add(rid, prompt, params(max_tokens=1))   the engine prefills and samples as usual
      ... first token out, request FINISHED: its blocks are *held*, not freed
    holds.block_table(rid)                         the blocks to send to the decode worker
    holds.release(rid)                             to the prefix cache (the next turn hits)
    holds.abort(rid)                               any state, held or not: blocks freed
    ids, pins = holds.pin(rid, start, stop)        one more reference on blocks a transfer
    holds.unpin(pins)                              reads while the prompt is still prefilled

Only requests added here are held, and only when they finish normally (stop or length); an
aborted or failed request frees its blocks at once.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from baton.engine.kv_cache import Block
from baton.engine.request import Request, RequestStatus
from baton.outputs import StepOutput
from baton.sampling_params import SamplingParams
from baton.session_hints import SessionHint

if TYPE_CHECKING:
    from baton.engine.llm_engine import LLMEngine


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
