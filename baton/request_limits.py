"""Size limits on what a request asks the gateway to compute, checked before the work
(`RequestLimits`, the gateway's --max-tools / --max-schema-bytes / --max-schema-depth /
--max-n, declared on its fields), and `RequestError`, a request field that is invalid. They
live in baton/ so that `baton up` can offer the gateway's flags without importing the gateway.

A request's preparation (gateway/prep_pool.py) costs in proportion to what it carries, and
some of it far more: a JSON Schema's meta-schema check costs about 20 µs a byte in pure
Python, and a grammar compiler may grow exponentially with `oneOf` / `anyOf` nesting. So,
before any of that work:

    n                             at most max_n completions           (400, param "n")
    tools                         at most max_tools entries           (400, param "tools")
    each tool's parameters,       at most max_schema_bytes of JSON    (400, param naming it:
    response_format's schema      and max_schema_depth nested levels   tools[3].function.
                                  (objects and arrays)                 parameters, ...)

Past them the request is a 400 naming the field; the preparation deadline (--prep-timeout-s)
covers whatever still takes too long within them.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from baton.flagspec import flag

# Most completions (`n`) per request: the default of the gateway's and the decode workers'
# --max-n, one flag name, so `baton up --max-n` sets both and the gateway refuses (400 naming
# `n`) what a decode worker would refuse.
DEFAULT_MAX_N = 16


class RequestError(ValueError):
    """A request field is invalid; `param` names it (OpenAI's error `param`)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param

    def __reduce__(self):  # pickled across the preparation pool (gateway/prep_pool.py)
        return type(self), (str(self), self.param)


@dataclass(frozen=True)
class RequestLimits:
    """max_tools: tools one chat request may offer. max_schema_bytes / max_schema_depth:
    bounds on each JSON Schema a request carries (a tool's parameters, response_format's
    schema), in bytes of compact JSON and in nested objects and arrays. max_n: completions
    one request may ask for (the decode workers' --max-n: the same flag in `baton up`)."""

    max_tools: int = flag(256, "most tools one chat request may offer (400 above)")
    max_schema_bytes: int = flag(
        128 << 10, "largest JSON schema (response_format, a tool's parameters) in bytes (400 "
                   "above)")
    max_schema_depth: int = flag(
        32, "deepest nesting of objects and arrays in a JSON schema (400 above)")
    max_n: int = flag(DEFAULT_MAX_N, "most completions per request")

    def __post_init__(self) -> None:
        if min(self.max_tools, self.max_schema_bytes, self.max_schema_depth, self.max_n) < 1:
            raise ValueError("max_tools, max_schema_bytes, max_schema_depth and max_n must be "
                             ">= 1")

    def check_n(self, n: int, param: str = "n") -> None:
        """RequestError naming `param` when more than max_n completions are asked for."""
        if n > self.max_n:
            raise RequestError(f"n must be at most {self.max_n}, got {n} (the gateway's and "
                               "the decode workers' --max-n)", param)

    def check_tools(self, num_tools: int) -> None:
        """RequestError naming `tools` when there are more than max_tools."""
        if num_tools > self.max_tools:
            raise RequestError(f"at most {self.max_tools} tools per request, got {num_tools} "
                               "(the gateway's --max-tools)", "tools")

    def schema_text(self, schema: Any, param: str) -> str:
        """The schema as compact JSON text, after checking its depth and size (RequestError
        naming `param`). Depth first: it stops at the limit, while encoding costs the whole."""
        depth = json_depth(schema, self.max_schema_depth)
        if depth > self.max_schema_depth:
            raise RequestError(f"the JSON schema nests deeper than {self.max_schema_depth} "
                               "levels (the gateway's --max-schema-depth)", param)
        text = json.dumps(schema, ensure_ascii=False, separators=(",", ":"))
        if len(text.encode()) > self.max_schema_bytes:
            raise RequestError(f"the JSON schema is {len(text.encode())} bytes, more than "
                               f"{self.max_schema_bytes} (the gateway's --max-schema-bytes)",
                               param)
        return text


def json_depth(value: Any, limit: int) -> int:
    """Nesting depth of a JSON value (a scalar: 0; {} or []: 1; {"a": []}: 2), counted up to
    limit + 1 and no further, so a hostile value costs at most the nodes above that level."""
    deepest = 0
    stack = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, dict):
            children = node.values()
        elif isinstance(node, list):
            children = node
        else:
            continue
        deepest = max(deepest, depth)
        if depth > limit:
            return depth
        stack.extend((child, depth + 1) for child in children)
    return deepest
