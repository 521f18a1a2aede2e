"""Which chat template the gateway renders with, and whether it can render tools.

The choice (`--chat-template FILE|tokenizer`, else a shipped tool-aware template for a
tokenizer whose template drops tools, else the tokenizer's) is baton/chat_format.py's,
shared with the benchmark client's token counter; it is re-exported here. Either way the
text is rendered by transformers' `apply_chat_template(chat_template=...)`, so a template
behaves exactly as it would in transformers.

A request that offers `tools` to a template that drops them would silently get a model that
never saw them; `tools_ignored()` finds that out once per template by rendering a probe
conversation with and without a probe tool, and the gateway then warns (log once per process,
and `X-Baton-Warning` on the response).
"""
from __future__ import annotations

import logging

from baton.chat_format import (  # noqa: F401  (re-exported: the gateway's names)
    SHIPPED,
    TEMPLATES_DIR,
    TOKENIZER,
    check_chat_template_option,
    resolve_chat_template,
    template_digest,
)

logger = logging.getLogger(__name__)

WARNING_HEADER = "X-Baton-Warning"
TOOLS_IGNORED = "tools ignored by the chat template"

_PROBE_MESSAGES = [{"role": "user", "content": "ping"}]
_PROBE_TOOLS = [{"type": "function", "function": {
    "name": "baton_probe_tool", "description": "probe",
    "parameters": {"type": "object", "properties": {}}}}]
_verdicts: dict[str, bool] = {}  # template sha256 → tools ignored
_warned: set[str] = set()


def tools_ignored(tokenizer, template: str | None) -> bool:
    """True when `template` (None: the tokenizer's) renders the probe conversation the same
    with and without tools; cached per template text. No template, or one that fails on the
    probe, gets the benefit of the doubt (False)."""
    text = template if template is not None else tokenizer.chat_template
    if text is None:
        return False
    key = template_digest(str(text))
    if key not in _verdicts:
        _verdicts[key] = _renders_the_same(tokenizer, template)
    return _verdicts[key]


def _renders_the_same(tokenizer, template: str | None) -> bool:
    def render(tools):
        return tokenizer.apply_chat_template(_PROBE_MESSAGES, tools=tools,
                                             chat_template=template, tokenize=False,
                                             add_generation_prompt=True)
    try:
        return render(_PROBE_TOOLS) == render(None)
    except Exception:  # a template that wants another conversation shape: no verdict
        return False


def warn_tools_ignored() -> None:
    """Log, once per process, that a request's tools were dropped."""
    if _warned:
        return
    _warned.add(TOOLS_IGNORED)
    logger.warning("a request offered tools, but the chat template ignores them: the model "
                   "never sees the tool schemas nor earlier calls; pass --chat-template FILE "
                   "with a tool-aware template (and --tool-call-parser for its format)")
