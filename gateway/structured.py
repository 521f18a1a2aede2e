"""Structured-output fields → the workers' StructuredOutput (protos/common.proto).

    a response format (OpenAI's response_format, the Responses API's text.format):
      text                                          → none
      json_object                                   → JSON_OBJECT
      json_schema {"name", "schema", ...}           → JSON_SCHEMA(schema)
    a forced tool_choice (tools offered; "required" / any / a named function)
                                                    → one call in the active parser's format

A forced call is written as the active tool-call parser reads it (gateway/tool_parsers.py,
`ToolParser.forced`), so its output parses back into a tool call:
    hermes       <tool_call>\n{"name": NAME, "arguments": ARGS}\n</tool_call>
    llama3_json  {"name": NAME, "parameters": ARGS}
    mistral      [TOOL_CALLS][{"name": NAME, "arguments": ARGS}]
ARGS valid under the tool's parameters. It takes precedence over a response format (the
answer is a call, not content).

Every schema is checked here, before any worker sees it, and a fault is a 400 whose `param`
names the field (`response_format.json_schema.schema`, `tools[3].function.parameters`,
`tools[3].input_schema`): its size and depth (gateway/limits.py), its JSON Schema
meta-schema (`jsonschema`), then the workers' own conversion into a grammar
(baton/json_schema.py: a `$ref` to a missing definition, `minimum` above `maximum`, an empty
`enum`, an unsupported regex...). A tool's parameters must be an object schema (its
arguments are a JSON object).
"""
from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import jsonschema

from baton.json_schema import grammar_from_json_schema
from gateway.errors import RequestError
from gateway.limits import RequestLimits
from gateway.tool_calls import CallFormat
from protos import common_pb2

_K = common_pb2
SCHEMA_PARAM = "response_format.json_schema.schema"


def parameters_param(index: int) -> str:
    """The `param` of the index-th tool's parameters."""
    return f"tools[{index}].function.parameters"


@dataclass(frozen=True)
class SchemaChecker:
    """Checks schemas within `limits`; `note(param)` is told which field it starts on (the
    preparation pool names it when its deadline passes: gateway/prep_pool.py)."""

    limits: RequestLimits = field(default_factory=RequestLimits)
    note: Callable[[str], None] = lambda param: None

    def checked(self, schema: Any, param: str) -> str:
        """checked_schema(schema, param, limits), noted first."""
        self.note(param)
        return checked_schema(schema, param, self.limits)


def from_output_format(kind: str, schema: Any, param: str,
                       checker: SchemaChecker) -> common_pb2.StructuredOutput | None:
    """kind: "text", "json_object" or "json_schema" (`schema`, named `param`). RequestError:
    an invalid schema."""
    if kind == "text":
        return None
    if kind == "json_object":
        return common_pb2.StructuredOutput(kind=_K.STRUCTURED_OUTPUT_KIND_JSON_OBJECT)
    return common_pb2.StructuredOutput(kind=_K.STRUCTURED_OUTPUT_KIND_JSON_SCHEMA,
                                       json_schema=checker.checked(schema, param))


def from_tool_choice(tools: Sequence[tuple[str, Any, str]], mode: str, name: str | None,
                     choice_param: str, fmt: CallFormat,
                     checker: SchemaChecker) -> common_pb2.StructuredOutput:
    """The grammar of one forced call in the parser's format `fmt`. tools: (name,
    parameters, the parameters' field) of each offered function; mode "required" (any of
    them) or "named" (`name`). RequestError: nothing to call, an unknown name (param
    `choice_param`), an invalid parameters schema (param naming the tool's)."""
    if mode == "required":
        chosen = list(tools)
        if not chosen:
            raise RequestError("a forced tool_choice needs at least one tool", choice_param)
    else:
        chosen = [t for t in tools if t[0] == name]
        if not chosen:
            raise RequestError(f"tool_choice names {name!r}, which is not among the tools",
                               choice_param)
    options = [_call_schema(n, params, param, fmt.arguments_key, checker)
               for n, params, param in chosen]
    schema = options[0] if len(options) == 1 else {"anyOf": options}
    if fmt.as_list:
        schema = {"type": "array", "items": schema, "minItems": 1, "maxItems": 1}
    # Each tool's parameters were checked on their own; the wrapper around them is ours.
    return common_pb2.StructuredOutput(kind=_K.STRUCTURED_OUTPUT_KIND_JSON_SCHEMA,
                                       json_schema=json.dumps(schema, ensure_ascii=False),
                                       prefix=fmt.prefix, suffix=fmt.suffix)


def _call_schema(name: str, parameters: Any, param: str, arguments_key: str,
                 checker: SchemaChecker) -> dict:
    """The JSON of one call: {"name": NAME, <arguments_key>: {...}}, name first."""
    arguments = object_schema(parameters, param)
    checker.checked(arguments, param)
    return {"type": "object",
            "properties": {"name": {"const": name}, arguments_key: arguments},
            "required": ["name", arguments_key], "additionalProperties": False}


def object_schema(parameters: Any, param: str) -> dict:
    """A tool's `parameters` as an object schema (None or {}: any object). RequestError
    naming `param` when it is not a JSON object or its `type` is not "object"."""
    if parameters is None or parameters == {}:
        return {"type": "object"}
    if not isinstance(parameters, dict):
        raise RequestError("a tool's parameters must be a JSON Schema object", param)
    kind = parameters.get("type", "object")
    if kind != "object":
        raise RequestError('a tool\'s parameters must be an object schema ({"type": '
                           f'"object", ...}}), got type {json.dumps(kind)}', param)
    return {"type": "object", **parameters}


def checked_schema(schema: Any, param: str, limits: RequestLimits) -> str:
    """The schema as JSON text; RequestError naming `param` unless it is within the limits,
    valid under its meta-schema (its own `$schema` draft, else the latest) and accepted by
    the workers' grammar converter (when xgrammar is installed here; without it the workers
    say which field they refuse, gateway/dispatch.py)."""
    if not isinstance(schema, (dict, bool)):
        raise RequestError("a JSON schema must be an object", param)
    text = limits.schema_text(schema, param)
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as e:
        where = "/".join(str(p) for p in e.absolute_path)
        raise RequestError(f"invalid JSON schema{f' at {where}' if where else ''}: "
                           f"{e.message}", param) from e
    try:
        grammar_from_json_schema(text)
    except ImportError:
        pass
    except ValueError as e:
        raise RequestError(str(e), param) from e
    return text


def check_proto(so: common_pb2.StructuredOutput, checker: SchemaChecker) -> None:
    """RequestError (param structured_output.json_schema) unless a StructuredOutput sent to
    the gRPC front has a valid schema."""
    param = "sampling_params.structured_output.json_schema"
    if so.kind == _K.STRUCTURED_OUTPUT_KIND_JSON_SCHEMA:
        try:
            schema = json.loads(so.json_schema)
        except json.JSONDecodeError as e:
            raise RequestError(f"structured_output.json_schema is not JSON: {e}", param) from e
        checker.checked(schema, param)
