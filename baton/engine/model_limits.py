"""A model's own limits, read once at load: its context length and its end-of-sequence ids."""
from __future__ import annotations

import json
import logging
from pathlib import Path

logger = logging.getLogger(__name__)


def max_model_len(model_config, max_position_embeddings: int, requested: int | None,
                  cache_tokens: int) -> int:
    """Tokens one sequence may hold: the requested limit (default the model's positions),
    within a sliding window if the model uses one (full attention equals sliding attention
    up to the window), within what the KV cache holds (warned)."""
    limit = requested or max_position_embeddings
    window = getattr(model_config, "sliding_window", None)
    if window and (getattr(model_config, "use_sliding_window", True) is not False):
        limit = min(limit, window)
    if cache_tokens < limit:
        logger.warning("KV cache holds %d tokens; capping max_model_len %d", cache_tokens,
                       limit)
    return min(limit, cache_tokens, max_position_embeddings)


def eos_token_ids(model_config, model_path: Path, tokenizer) -> frozenset[int]:
    """EOS ids from the model config, generation_config.json and the tokenizer, together."""
    ids = set()
    for value in (getattr(model_config, "eos_token_id", None), _generation_eos(model_path),
                  tokenizer.eos_token_id):
        ids.update(value if isinstance(value, list) else [value] if value is not None else [])
    return frozenset(ids)


def _generation_eos(model_path: Path):
    gen = model_path / "generation_config.json"
    return json.loads(gen.read_text()).get("eos_token_id") if gen.is_file() else None
