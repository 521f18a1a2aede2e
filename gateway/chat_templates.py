"""Which chat template the gateway renders with, and whether it can render tools.

    --chat-template FILE        that Jinja file replaces the tokenizer's template
    --chat-template tokenizer   the tokenizer's own template, even where Baton ships a better one
    (no flag)                   a shipped tool-aware template when the tokenizer's template is
                                one Baton knows to ignore tools (SmolLM2's), else the tokenizer's

Either way the text is rendered by transformers' `apply_chat_template(chat_template=...)`, so
a template behaves exactly as it would in transformers.

A request that offers `tools` to a template that drops them would silently get a model that
never saw them; `tools_ignored()` finds that out once per template by rendering a probe
conversation with and without a probe tool, and the gateway then warns (log once per process,
and `X-Baton-Warning` on the response).
"""
from __future__ import annotations

import hashlib
import logging
from pathlib import Path

logger = logging.getLogger(__name__)

TEMPLATES_DIR = Path(__file__).parent / "templates"
TOKENIZER = "tokenizer"
WARNING_HEADER = "X-Baton-Warning"
TOOLS_IGNORED = "tools ignored by the chat template"

# sha256 of a tokenizer's own template → the shipped template that replaces it by default.
# SmolLM2-Instruct's ChatML (135M, 360M and 1.7B share it): drops tools and tool_calls.
SHIPPED: dict[str, str] = {
    "872be49dbb638044ad01b60388f48d469ff2980e5f0dccdc22ec907db54d0788": "smollm2_tools.jinja",
}

_PROBE_MESSAGES = [{"role": "user", "content": "ping"}]
_PROBE_TOOLS = [{"type": "function", "function": {
    "name": "baton_probe_tool", "description": "probe",
    "parameters": {"type": "object", "properties": {}}}}]
_verdicts: dict[str, bool] = {}  # template sha256 → tools ignored
_warned: set[str] = set()


def template_digest(template: str) -> str:
    return hashlib.sha256(template.encode()).hexdigest()


def check_chat_template_option(option: str | None) -> None:
    """ValueError unless `option` is None, "tokenizer" or a readable file."""
    if option not in (None, TOKENIZER) and not Path(option).expanduser().is_file():
        raise ValueError(f"--chat-template {option}: no such file")


def resolve_chat_template(option: str | None, tokenizer_template: str | None) -> str | None:
    """The template text to render with; None means the tokenizer's own (see the docstring)."""
    if option == TOKENIZER:
        return None
    if option is not None:
        return Path(option).expanduser().read_text()
    shipped = SHIPPED.get(template_digest(tokenizer_template or ""))
    if shipped is None:
        return None
    logger.info("chat template: shipped %s replaces the tokenizer's (it ignores tools)", shipped)
    return (TEMPLATES_DIR / shipped).read_text()


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
