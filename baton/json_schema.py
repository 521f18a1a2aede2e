"""A JSON Schema as a grammar: xgrammar's converter with the options every role uses.

The decode and prefill workers compile the result (baton/engine/grammar.py); the gateway
converts every schema before routing (gateway/structured.py), so a schema the workers would
refuse is refused there, as a 400 naming its field. What a worker still refuses it refuses
with a FieldError, whose field travels in the status's trailing metadata. xgrammar is
imported on first use (it imports torch): importing this module costs nothing.
"""
from __future__ import annotations

# The request field a refused structured output is, named in the gRPC status's trailing
# metadata under FIELD_METADATA, so the gateway can name its own field in its 400.
STRUCTURED_OUTPUT_FIELD = "sampling_params.structured_output"
FIELD_METADATA = "baton-field"


class FieldError(ValueError):
    """A request field a role refuses (INVALID_ARGUMENT); `field` names it in the role's
    proto request (e.g. STRUCTURED_OUTPUT_FIELD)."""

    def __init__(self, message: str, field: str) -> None:
        super().__init__(message)
        self.field = field

    def trailing_metadata(self) -> tuple[tuple[str, str], ...]:
        """The gRPC trailing metadata that names the field."""
        return ((FIELD_METADATA, self.field),)


def grammar_from_json_schema(schema: str):
    """xgrammar's Grammar of the JSON Schema text `schema` (whitespace between JSON tokens
    fixed: small models otherwise fill the output with newlines). ValueError with
    xgrammar's reason for a schema it cannot convert; ImportError without xgrammar."""
    import xgrammar as xgr

    try:
        return xgr.Grammar.from_json_schema(schema, any_whitespace=False)
    except (RuntimeError, ValueError, TypeError) as e:
        raise ValueError(f"json_schema is not supported: {short_error(e)}") from e


def short_error(e: Exception) -> str:
    """xgrammar's C++ messages start with '[time] /path/file.cc:line: '; keep the reason."""
    text = str(e).strip()
    return text.split(": ", 1)[1] if text.startswith("[") and ": " in text else text
