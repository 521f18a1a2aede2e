"""A null is the field's default: OpenAI's optional request fields are nullable.

Clients that serialize every field of their request type send `"n": null`, `"stream": null`
or `"logprobs": null` for the ones they leave unset; OpenAI and vLLM (whose fields are
`Optional[...] = default`) read such a null as the default. The bodies here keep plain
types (`n: int = 1`), so a `mode="before"` model validator drops the null of every field
that has a default and takes no None itself; a required field's null is kept, to be refused
with a 400 naming it.
"""
from __future__ import annotations

import types
from typing import Any, Union, get_args, get_origin

from pydantic import BaseModel


def drop_defaulted_nulls(model: type[BaseModel], data: Any) -> Any:
    """`data` (a body about to be validated as `model`) without the nulls of the fields that
    have a default and do not accept None."""
    if not isinstance(data, dict) or None not in data.values():
        return data
    fields = model.model_fields
    return {k: v for k, v in data.items()
            if v is not None or k not in fields or fields[k].is_required()
            or _takes_none(fields[k].annotation)}


def _takes_none(annotation: Any) -> bool:
    if annotation is Any or annotation is None or annotation is type(None):
        return True
    if get_origin(annotation) in (Union, types.UnionType):
        return any(_takes_none(a) for a in get_args(annotation))
    return False
