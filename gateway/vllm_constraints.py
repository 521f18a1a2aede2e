"""vLLM's output-constraint fields on chat and completions: enforced where Baton's grammar can
(JSON), refused with a 400 where it cannot, never dropped.

A constraint dropped without an error is worse than a refusal: the request "works" and its
output breaks the constraint (`structured_outputs: {"choice": ["yes", "no"]}` answered
"Yes."). So:
- `structured_outputs` (vLLM's `StructuredOutputsParams`): `json` (a schema, as an object or
  as JSON text) and `json_object: true` become the same OutputFormat as `response_format`;
  `regex`, `choice`, `grammar` and `structural_tag` are 400s; as in vLLM exactly one kind
  must be given, and here not beside a `response_format` that asks for JSON;
- `allowed_token_ids`, `bad_words`, vLLM's older `guided_json` / `guided_regex` /
  `guided_choice` / `guided_grammar`, and `use_beam_search: true` are 400s when set (a null,
  empty or false value is the default and passes).
"""
from __future__ import annotations

import json
from typing import Any

from gateway.errors import RequestError
from gateway.front_door import OutputFormat

_KINDS = ("json", "json_object", "regex", "choice", "grammar", "structural_tag")
_UNSUPPORTED = ("allowed_token_ids", "bad_words", "guided_json", "guided_regex",
                "guided_choice", "guided_grammar", "use_beam_search")
_USE = "this server enforces JSON only: `structured_outputs.json`, " \
       "`structured_outputs.json_object` or `response_format`"
_WHY = {"use_beam_search": "it samples; it has no beam search"}  # else _USE


def refuse_unsupported(extra: dict[str, Any]) -> None:
    """Raises RequestError (400, param = the field) for a set output constraint of vLLM that
    Baton does not enforce; `extra` is the request's unknown fields (pydantic model_extra)."""
    for name in _UNSUPPORTED:
        if extra.get(name) not in (None, False, "", [], {}):
            raise RequestError(f"`{name}` is not supported by this server "
                               f"({_WHY.get(name, _USE)}).", name)


def structured_outputs_format(value: Any, response_format: OutputFormat | None
                              ) -> OutputFormat | None:
    """vLLM's `structured_outputs` object → the OutputFormat it asks for (None when absent).
    Raises RequestError (param `structured_outputs[.kind]`) for a value that is not an
    object, for zero or several kinds, for a kind other than json / json_object, for a
    `json` that is neither an object nor JSON text of one, and beside a JSON
    `response_format`."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise RequestError("structured_outputs must be an object", "structured_outputs")
    kinds = [k for k in _KINDS if value.get(k) not in (None, False)]
    if len(kinds) != 1:
        raise RequestError("structured_outputs needs exactly one of " + ", ".join(_KINDS) +
                           f" (got {len(kinds)})", "structured_outputs")
    kind, param = kinds[0], f"structured_outputs.{kinds[0]}"
    if kind not in ("json", "json_object"):
        raise RequestError(f"{param} is not supported ({_USE}).", param)
    if response_format is not None:
        raise RequestError("give either response_format or structured_outputs, not both",
                           "structured_outputs")
    if kind == "json_object":
        return OutputFormat("json_object")
    schema = value["json"]
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as e:
            raise RequestError(f"{param} is not valid JSON: {e}", param) from None
    if not isinstance(schema, dict):
        raise RequestError(f"{param} must be a JSON Schema object", param)
    return OutputFormat("json_schema", schema, param)
