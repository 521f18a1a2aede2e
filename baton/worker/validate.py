"""Checks every worker applies to an incoming request before any work (one copy).

    check_request(rid, n_prompt, max_prompt_tokens, accepting, role)
        not accepting      → Rejected(UNAVAILABLE)      the worker is shutting down
        bad request id     → ValueError                 (INVALID_ARGUMENT)
        empty / too long   → ValueError
"""
from __future__ import annotations

import grpc

from baton.worker.process import MAX_REQUEST_ID_LEN, Rejected

def check_request(request_id: str, num_prompt_tokens: int, max_prompt_tokens: int,
                  accepting: bool, role: str) -> None:
    """Raise Rejected(UNAVAILABLE) while draining, ValueError for an id outside
    1..MAX_REQUEST_ID_LEN characters or a prompt empty or over `max_prompt_tokens`.
    `role` names the worker in messages ("decode worker", "prefill worker")."""
    if not accepting:
        raise Rejected(grpc.StatusCode.UNAVAILABLE, f"{role} is shutting down")
    if not request_id or len(request_id) > MAX_REQUEST_ID_LEN:
        raise ValueError(f"request_id must have 1..{MAX_REQUEST_ID_LEN} characters")
    if num_prompt_tokens == 0:
        raise ValueError("prompt_token_ids is empty")
    if num_prompt_tokens > max_prompt_tokens:
        raise ValueError(f"prompt has {num_prompt_tokens} tokens, over this {role}'s limit "
                         f"of {max_prompt_tokens} (--max-prompt-tokens)")
