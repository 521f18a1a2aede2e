"""How a chat request becomes template input: the shipped chat templates and the message
normalization, shared by the gateway (gateway/prompts.py, gateway/chat_templates.py) and the
benchmark client's token counter (baton/bench/tokens.py), so both render the same text.

Template choice (the gateway's --chat-template):
    --chat-template FILE        that Jinja file replaces the tokenizer's template
    --chat-template tokenizer   the tokenizer's own template, even where Baton ships a better one
    (no flag)                   a shipped tool-aware template (baton/templates/) when the
                                tokenizer's template is one Baton knows to ignore tools
                                (SmolLM2's), else the tokenizer's

Messages are normalized before templating, because real templates are strict and OpenAI
clients send shapes they do not expect:
- content parts [{"type": "text", "text": ...}] are joined into one string;
- content null (assistant tool-call turns) becomes "" (SmolLM2's template fails on None);
- tool_calls[].function.arguments arrive as JSON text; templates (Qwen, Hermes) expect a
  mapping, so valid JSON objects are parsed, anything else stays text;
- role "developer" (OpenAI's name for the system prompt since o1; the Agents SDK and Codex
  send it) becomes "system" unless the template itself names the role: Llama, Mistral, Qwen
  and SmolLM2 templates do not, and would render an unknown role (or fail) beside their
  default system prompt, as the Responses API's items already map it;
- OpenAI's legacy function calling (still in its spec, sent by older clients and agent
  frameworks): an assistant's `function_call` becomes its one tool call and a "function"
  message (the call's result) a "tool" message, so templates render them as the tool turns
  they are.
Nothing here imports torch or the gateway.
"""
from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path
from typing import Any

from baton.request_limits import RequestError

logger = logging.getLogger(__name__)

TEMPLATES_DIR = Path(__file__).parent / "templates"
TOKENIZER = "tokenizer"

# sha256 of a tokenizer's own template → the shipped template that replaces it by default.
# SmolLM2-Instruct's ChatML (135M, 360M and 1.7B share it): drops tools and tool_calls.
SHIPPED: dict[str, str] = {
    "872be49dbb638044ad01b60388f48d469ff2980e5f0dccdc22ec907db54d0788": "smollm2_tools.jinja",
}


class PromptError(RequestError):
    """The prompt cannot be rendered or tokenized; `param` names the offending field."""


def template_digest(template: str) -> str:
    """sha256 hex digest of a template's text (the key of SHIPPED)."""
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


# OpenAI's text content parts and the key of their text: an assistant's `refusal` parts
# are text too (vLLM reads them so).
_TEXT_KEYS = {"text": "text", "refusal": "refusal"}


def message_text(content: Any) -> str:
    """OpenAI content (None, a string, or a list of text or refusal parts) → one string, the
    parts joined by a newline as vLLM joins them (`renderers/chat_utils.py`), so a system
    prompt given in parts does not run its sentences together (PromptError naming `messages`
    for a part that is not text)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    parts = []
    for part in content:
        key = _TEXT_KEYS.get(part.get("type"))
        if key is None:
            raise PromptError(f"content part of type {part.get('type')!r} is not supported "
                              "(text only)", "messages")
        if not isinstance(part.get(key), str):
            raise PromptError(f"a {part['type']} content part needs a `{key}` string",
                              "messages")
        parts.append(part[key])
    return "\n".join(parts)


def knows_developer_role(template: Any) -> bool:
    """Whether a chat template (its text; None or a dict of named templates: no) renders
    the "developer" role itself, so it is passed through instead of becoming "system"."""
    return isinstance(template, str) and "developer" in template


def normalize_message(message: dict[str, Any], developer_as_system: bool = True
                      ) -> dict[str, Any]:
    """One OpenAI chat message → the plain shape chat templates expect (see the docstring:
    content, tool calls, legacy function calling); `developer_as_system`: a "developer"
    message becomes a "system" one."""
    out = {k: v for k, v in message.items()
           if v is not None and k not in ("content", "function_call")}
    if developer_as_system and out.get("role") == "developer":
        out["role"] = "system"
    if out.get("role") == "function":
        out["role"] = "tool"
    out["content"] = message_text(message.get("content"))
    legacy = message.get("function_call")
    calls = message.get("tool_calls") or ([{"function": legacy}] if legacy else None)
    if calls:
        out["tool_calls"] = [_normalize_tool_call(c) for c in calls]
    return out


def _normalize_tool_call(call: dict[str, Any]) -> dict[str, Any]:
    function = dict(call.get("function") or {})
    args = function.get("arguments")
    if isinstance(args, str):
        try:
            parsed = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError:
            parsed = args
        function["arguments"] = parsed if isinstance(parsed, dict) else args
    out = {"type": call.get("type") or "function", "function": function}
    if call.get("id"):
        out["id"] = call["id"]
    return out
