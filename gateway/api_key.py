"""The API key's check, shared by the HTTP guard (gateway/asgi.py) and the gRPC front's
interceptor (gateway/grpc_front.py)."""
from __future__ import annotations

import hmac


def bearer_matches(authorization: bytes, key: bytes) -> bool:
    """Whether an `Authorization` header (or gRPC `authorization` metadata) value is
    `Bearer KEY` for this key: the scheme matched in any case (RFC 9110 section 11.1; vLLM's
    check does the same), blanks around the value and between scheme and token ignored, the
    token compared in constant time (`hmac.compare_digest`)."""
    scheme, _, token = authorization.strip().partition(b" ")
    return hmac.compare_digest(token.strip(), key) and scheme.lower() == b"bearer"
