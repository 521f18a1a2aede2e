"""Prompts → token ids: the served model's tokenizer and chat template, and the context limit.

Chat messages are normalized before templating (baton/chat_format.py: text parts joined,
content null → "", tool-call arguments parsed into mappings), as the benchmark client's
token counter normalizes them. Tools go to `apply_chat_template(tools=...)`. The template is
the tokenizer's, or the one gateway/chat_templates.py chose (`--chat-template`, or a shipped
tool-aware one); whether it drops tools is found out once (`tools_ignored`) so the gateway
can say so. Requests are templated and tokenized in the preparation pool's processes
(gateway/prep_pool.py), each with its own PromptBuilder (pickled over: the tokenizer, the
limit and the template); a session's turns are tokenized incrementally
(gateway/session_tokens.py).
"""
from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path
from typing import Any

from baton.chat_format import (  # noqa: F401  (re-exported: the gateway's names)
    PromptError,
    knows_developer_role,
    message_text,
    normalize_message,
)
from gateway.chat_templates import resolve_chat_template, tools_ignored
from gateway.errors import RequestError
from gateway.piece_cache import PieceTokenizer
from gateway.session_tokens import SessionTokens
from gateway.token_bytes import token_bytes_reader

# Arguments of apply_chat_template and variables its renderer sets: not for
# chat_template_kwargs to override.
RESERVED_TEMPLATE_KWARGS = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length",
    "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs"})


class PromptBuilder:
    """Tokenizer + chat template + context limit of the served model. chat_template: Jinja
    text that replaces the tokenizer's template (None: the tokenizer's own)."""

    def __init__(self, tokenizer, max_model_len: int, chat_template: str | None = None) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.chat_template = chat_template
        self.encoder = PieceTokenizer(tokenizer)
        self.sessions = SessionTokens(self.encoder)
        self.vocab_size = len(tokenizer)
        self.token_text = lru_cache(maxsize=1 << 16)(self._token_text)
        # the raw bytes of a token (logprobs' `bytes`), read by gateway/logprobs_output.py
        self.token_text.bytes = lru_cache(maxsize=1 << 16)(
            token_bytes_reader(tokenizer, self._token_text))
        self.developer_as_system = not knows_developer_role(
            chat_template if chat_template is not None else tokenizer.chat_template)

    def __reduce__(self):  # to the preparation pool's children: the tokenizer, not the caches
        return type(self), (self.tokenizer, self.max_model_len, self.chat_template)

    @classmethod
    def from_folder(cls, folder: str | Path, max_model_len: int | None = None,
                    chat_template_option: str | None = None) -> PromptBuilder:
        """Load the tokenizer from a Hugging Face folder; the context limit is max_model_len
        or the model's max_position_embeddings (ValueError when neither is known); the
        template from `--chat-template`'s value (gateway/chat_templates.py)."""
        from transformers import AutoTokenizer

        folder = Path(folder)
        tokenizer = AutoTokenizer.from_pretrained(folder)
        if max_model_len is None:
            config = json.loads((folder / "config.json").read_text())
            max_model_len = config.get("max_position_embeddings")
            if not max_model_len:
                raise ValueError(f"{folder}: no max_position_embeddings; pass --max-model-len")
        return cls(tokenizer, int(max_model_len),
                   resolve_chat_template(chat_template_option, tokenizer.chat_template))

    def chat_token_ids(self, messages: list[dict[str, Any]],
                       tools: list[dict[str, Any]] | None = None,
                       add_generation_prompt: bool = True,
                       add_special_tokens: bool = False, session_id: str = "",
                       continue_final_message: bool = False,
                       template_kwargs: dict[str, Any] | None = None) -> list[int]:
        """Render normalized messages through the chat template and tokenize (incrementally
        from the session's last prompt when `session_id` is set: gateway/session_tokens.py).
        continue_final_message: the last message (an assistant's) is left open, so the
        output continues its text (transformers' option; Anthropic's prefill).
        template_kwargs: more template variables (vLLM's chat_template_kwargs); one the
        renderer sets itself is a PromptError naming `chat_template_kwargs`."""
        if not messages:
            raise PromptError("messages must be a non-empty list", "messages")
        if continue_final_message and add_generation_prompt:
            raise PromptError("continue_final_message and add_generation_prompt cannot both "
                              "be true", "continue_final_message")
        taken = RESERVED_TEMPLATE_KWARGS.intersection(template_kwargs or ())
        if taken:
            raise PromptError(f"chat_template_kwargs may not set {sorted(taken)} (the request's "
                              "own fields set them)", "chat_template_kwargs")
        if self.chat_template is None and self.tokenizer.chat_template is None:
            raise PromptError("the served model has no chat template; use /v1/completions",
                              "messages")
        try:
            text = self.tokenizer.apply_chat_template(
                [normalize_message(m, self.developer_as_system) for m in messages],
                tools=tools or None, chat_template=self.chat_template,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message, tokenize=False,
                **(template_kwargs or {}))
        except RequestError:  # PromptError included: a message the template cannot take
            raise
        except Exception as e:  # jinja's TemplateError and friends: the request's fault
            raise PromptError(f"chat template failed: {e}", "messages") from e
        return self.sessions.encode(session_id, text, add_special_tokens)

    @property
    def tools_ignored(self) -> bool:
        """Whether the chat template drops `tools` (worked out once per template)."""
        return tools_ignored(self.tokenizer, self.chat_template)

    def text_token_ids(self, text: str, session_id: str = "") -> list[int]:
        """A completion prompt's token ids, BOS included (PromptError when empty); incremental
        from the session's last prompt when `session_id` is set."""
        if not text:
            raise PromptError("prompt must not be empty", "prompt")
        return self.sessions.encode(session_id, text, add_special_tokens=True)

    def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of any text, "" included (BOS and the like when add_special_tokens)."""
        return self.encoder.encode(text, add_special_tokens=add_special_tokens)

    def check_token_ids(self, ids: list[int], param: str = "prompt",
                        allow_empty: bool = False) -> list[int]:
        """`ids` when every one is in the vocabulary (PromptError naming `param` otherwise)."""
        if not ids and not allow_empty:
            raise PromptError(f"{param} must not be empty", param)
        bad = next((t for t in ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise PromptError(f"token id {bad} is outside the vocabulary [0, {self.vocab_size})",
                              param)
        return ids

    def token_strs(self, ids: list[int]) -> list[str]:
        """The vocabulary's own strings of `ids` (e.g. "Ġworld"), as vLLM's /tokenize shows."""
        return self.tokenizer.convert_ids_to_tokens(ids)

    def detokenize(self, ids: list[int]) -> str:
        """The text of `ids`, special tokens included (PromptError for an unknown id)."""
        return self.tokenizer.decode(self.check_token_ids(ids, "tokens", allow_empty=True))

    def _token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

