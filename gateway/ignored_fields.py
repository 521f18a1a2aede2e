"""Fields a request sent that the gateway does not act on: logged once, named in a header.

Bodies accept unknown fields rather than refusing them (OpenAI clients send many, and new
ones appear), but a parameter dropped without a word changes results without telling anyone.
So, per request:
  1. the top-level request models keep unknown fields (`extra="allow"`, gateway/protocol.py);
     `ignored_fields(body)` names them, and the unknown parts of `stream_options` as
     `stream_options.<part>`;
  2. a null value is not listed (null means unset), nor a field of KNOWN_HARMLESS (it cannot
     change the output), nor a field of IGNORED_AT_DEFAULT sent with that default; a known
     field whose value asks for more than the gateway does is added by the request model
     (`unenforced_fields`);
  3. `IgnoredFieldLog.note` logs each new name once per process (WARNING, with the endpoint);
  4. `ignored_header(names)` is the `X-Baton-Ignored-Fields: a,b` header of the response,
     streaming or not.
"""
from __future__ import annotations

import logging
import re

from pydantic import BaseModel

logger = logging.getLogger(__name__)

HEADER = "X-Baton-Ignored-Fields"

# Known fields the gateway accepts and deliberately does nothing with, whatever their value,
# because they cannot change the generated tokens.
KNOWN_HARMLESS = frozenset({
    "metadata",            # OpenAI's stored-completion tags: nothing is stored
    "store",               # likewise
    "service_tier",        # there is one tier
    "cache_control",       # Anthropic's cache breakpoints: every prefix is cached anyway
    "safety_identifier",   # OpenAI's abuse-monitoring id
})

# Known fields ignored only at the value that describes what Baton does anyway; any other
# value is listed as ignored.
IGNORED_AT_DEFAULT: dict[str, object] = {
    "parallel_tool_calls": True,  # /v1/completions: no tool calls (chat and Responses act on it)
    "best_of": 1,                 # no server-side best-of
}

# What a header value may carry of a client's field name (no commas, no control bytes).
_PRINTABLE = re.compile(r"[A-Za-z0-9_.\-]{1,64}")
_MAX_LISTED = 32


def ignored_fields(body: BaseModel, **parts: BaseModel | None) -> list[str]:
    """Sorted names of the fields of `body` that nothing reads, and of its nested `parts`
    (e.g. stream_options=body.stream_options) as "part.field"."""
    found = dict(body.model_extra or {})
    for prefix, part in parts.items():
        if part is not None:
            found.update({f"{prefix}.{k}": v for k, v in (part.model_extra or {}).items()})
    return sorted(name for name, value in found.items() if _reported(name, value))


def _reported(name: str, value: object) -> bool:
    if value is None or name in KNOWN_HARMLESS:
        return False
    return name not in IGNORED_AT_DEFAULT or IGNORED_AT_DEFAULT[name] != value


def ignored_header(names: list[str]) -> dict[str, str]:
    """The response header naming `names` ({} when there are none). Names that are not plain
    identifiers, and any past the first 32, show as a trailing "..."."""
    if not names:
        return {}
    shown = [n for n in names if _PRINTABLE.fullmatch(n)][:_MAX_LISTED]
    if len(shown) < len(names):
        shown.append("...")
    return {HEADER: ",".join(shown)}


class IgnoredFieldLog:
    """Logs each ignored field name once per process (the gateway holds one). The names come
    from clients, so only the first MAX_NAMES distinct ones are remembered and logged."""

    MAX_NAMES = 1024

    def __init__(self) -> None:
        self._seen: set[str] = set()

    def note(self, endpoint: str, names: list[str]) -> None:
        """Log the names of `names` not logged before (WARNING)."""
        for name in names:
            if name in self._seen or len(self._seen) >= self.MAX_NAMES:
                continue
            self._seen.add(name)
            logger.warning("%s: ignoring request field %r (it has no effect here; named in "
                           "the %s response header)", endpoint, name, HEADER)
