"""OpenAI's structured-output fields → the workers' StructuredOutput (protos/common.proto).

    response_format {"type": "text"}                         → none
    response_format {"type": "json_object"}                  → JSON_OBJECT
    response_format {"type": "json_schema",
                     "json_schema": {"name", "schema", ...}} → JSON_SCHEMA(schema)
    tool_choice "required" (tools offered)                   → one hermes call of any tool
    tool_choice {"type": "function", "function": {"name"}}   → one hermes call of that tool

A forced tool call is the grammar `<tool_call>\\n{"name": NAME, "arguments": ARGS}\\n</tool_call>`
(gateway/tool_calls.py parses it back into `tool_calls`), ARGS valid under the tool's
`parameters`. It takes precedence over response_format (the answer is a call, not content).
Schemas are checked against their JSON Schema meta-schema here (`jsonschema`), so a malformed
one is a 400 before any worker sees it; a well-formed schema the workers' grammar library
cannot compile comes back from them as INVALID_ARGUMENT, also a 400.
"""
from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import jsonschema

from gateway.tool_calls import CLOSE, OPEN
from protos import common_pb2

_K = common_pb2


def from_response_format(kind: str, schema: Any) -> common_pb2.StructuredOutput | None:
    """kind: response_format.type; schema: json_schema.schema (json_schema only). ValueError:
    a missing or malformed schema."""
    if kind == "text":
        return None
    if kind == "json_object":
        return common_pb2.StructuredOutput(kind=_K.STRUCTURED_OUTPUT_KIND_JSON_OBJECT)
    if schema is None:
        raise ValueError("response_format json_schema needs json_schema.schema")
    return common_pb2.StructuredOutput(kind=_K.STRUCTURED_OUTPUT_KIND_JSON_SCHEMA,
                                       json_schema=checked_schema(schema))


def from_tool_choice(tools: Sequence[tuple[str, dict | None]],
                     tool_choice: Any) -> common_pb2.StructuredOutput | None:
    """tools: (name, parameters) of each offered function; tool_choice as sent. None unless a
    call is forced. ValueError: nothing to call, an unknown name, a malformed parameters."""
    if tool_choice in (None, "none", "auto"):
        return None
    if tool_choice == "required":
        chosen = list(tools)
    else:
        name = _forced_name(tool_choice)
        chosen = [t for t in tools if t[0] == name]
        if not chosen:
            raise ValueError(f"tool_choice names {name!r}, which is not among the tools")
    if not chosen:
        raise ValueError('tool_choice "required" needs at least one tool')
    options = [_call_schema(name, params) for name, params in chosen]
    schema = options[0] if len(options) == 1 else {"anyOf": options}
    return common_pb2.StructuredOutput(kind=_K.STRUCTURED_OUTPUT_KIND_JSON_SCHEMA,
                                       json_schema=checked_schema(schema),
                                       prefix=OPEN + "\n", suffix="\n" + CLOSE)


def _forced_name(tool_choice: Any) -> str:
    function = tool_choice.get("function") if isinstance(tool_choice, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    if tool_choice.get("type", "function") != "function" or not isinstance(name, str):
        raise ValueError('tool_choice must be "none", "auto", "required" or '
                         '{"type": "function", "function": {"name": ...}}')
    return name


def _call_schema(name: str, parameters: dict | None) -> dict:
    """The JSON of one hermes call: {"name": NAME, "arguments": {...}}, name first."""
    return {"type": "object",
            "properties": {"name": {"const": name},
                           "arguments": parameters or {"type": "object"}},
            "required": ["name", "arguments"], "additionalProperties": False}


def checked_schema(schema: Any) -> str:
    """The schema as JSON text; ValueError unless it is a valid JSON Schema (its own
    `$schema` draft, else the latest)."""
    if not isinstance(schema, (dict, bool)):
        raise ValueError("a JSON schema must be an object")
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as e:
        where = "/".join(str(p) for p in e.absolute_path)
        raise ValueError(f"invalid JSON schema{f' at {where}' if where else ''}: "
                         f"{e.message}") from e
    return json.dumps(schema, ensure_ascii=False)


def check_proto(so: common_pb2.StructuredOutput) -> None:
    """ValueError unless a StructuredOutput sent to the gRPC front has a valid schema."""
    if so.kind == _K.STRUCTURED_OUTPUT_KIND_JSON_SCHEMA:
        try:
            schema = json.loads(so.json_schema)
        except json.JSONDecodeError as e:
            raise ValueError(f"structured_output.json_schema is not JSON: {e}") from e
        checked_schema(schema)
