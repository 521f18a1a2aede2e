"""Command-line flags declared once, on the config dataclasses' fields, and the parsers built
from them (the way vLLM builds `EngineArgs` from its configs).

    @dataclass(frozen=True)
    class CacheConfig:
        block_size: int = flag(16, "tokens per KV block")

    add_flags(parser, EngineConfig)          one argparse flag per flagged field, nested
                                             configs (EngineConfig.cache) flattened
    build(EngineConfig, parser.parse_args()) the frozen config back, nested ones included

A field's flag is `--field-name` unless `Flag.name` says otherwise; its type, default and
choices come from the field: `int`, `float`, `str`, `X | None` (a value or the default None),
`bool` (`--name` / `--no-name`), an `Enum` (its values), `tuple[str, ...]` (repeatable,
comma-separated). A field without `flag()` metadata is no flag (computed, or set by code).
`Flag.cluster` is False for what only one process can know (its bind address, its port):
`baton up` sets those itself and offers every other flag of every role (cluster/flags.py).
Nothing here imports torch: the gateway and `baton up` build their parsers from it.
"""
from __future__ import annotations

import argparse
import dataclasses
import enum
import types
import typing
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple


@dataclasses.dataclass(frozen=True)
class Flag:
    """How one config field appears on the command line.

    help: what it does (the default is appended by the help formatter). name: the flag
    (default `--` + field name with dashes). aliases: more option strings. parse: text →
    value, replacing the field type's (e.g. "auto" → None). choices: allowed values (after
    `parse`). metavar: the value's name in --help. cluster: `baton up` offers it (False: the
    flag names one process's own address, port or files)."""

    help: str
    name: str | None = None
    aliases: tuple[str, ...] = ()
    parse: Callable[[str], Any] | None = None
    choices: tuple | None = None
    metavar: str | None = None
    cluster: bool = True


_KEY = "baton_flag"


def flag(default: Any = dataclasses.MISSING, help: str = "", *, repr: bool = True,
         **kw) -> Any:
    """A dataclass field with a default and a command-line flag (kw: Flag's fields;
    repr=False keeps a secret out of the config's repr)."""
    return dataclasses.field(default=default, repr=repr, metadata={_KEY: Flag(help, **kw)})


class FlagSpec(NamedTuple):
    """One flag of a config class: where its value goes (`path` of field names from the
    root config), its option strings, argparse's dest, the field's type and default."""

    path: tuple[str, ...]
    owner: str
    flag: Flag
    option: str
    dest: str
    type: Any
    default: Any


def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _is_config(tp: Any) -> bool:
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


def _field_default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None


def specs(cls: type, prefix: tuple[str, ...] = (), defaults: Any = None) -> Iterator[FlagSpec]:
    """Every flag of `cls` and of the config dataclasses nested in it, in field order. A
    nested config's defaults are those of the instance its field defaults to (a role may
    give its ServerConfig another port); `defaults` is that instance inside the recursion."""
    hints = _hints(cls)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        default = getattr(defaults, f.name) if defaults is not None else _field_default(f)
        if _is_config(tp):
            yield from specs(tp, prefix + (f.name,), default)
            continue
        meta = f.metadata.get(_KEY)
        if meta is None:
            continue
        option = meta.name or "--" + f.name.replace("_", "-")
        dest = option[2:].replace("-", "_")
        yield FlagSpec(prefix + (f.name,), cls.__name__, meta, option, dest, tp, default)


def _optional(tp: Any) -> Any:
    """X for `X | None`, else tp."""
    if isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union:
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return tp


def _split_values(values: list[str] | tuple[str, ...] | None) -> tuple[str, ...]:
    """Repeated and comma-separated values → a tuple, blanks and repeats dropped."""
    out: list[str] = []
    for value in values or ():
        out.extend(v.strip() for v in value.split(",") if v.strip())
    return tuple(dict.fromkeys(out))


def argparse_kwargs(s: FlagSpec) -> dict[str, Any]:
    """add_argument's keyword arguments for `s`."""
    tp, meta = _optional(s.type), s.flag
    kw: dict[str, Any] = {"dest": s.dest, "help": meta.help, "default": s.default}
    if tp is bool:
        kw["action"] = argparse.BooleanOptionalAction
        return kw
    if typing.get_origin(tp) is tuple and meta.parse is None:
        kw.update(action="append", default=None)
    else:
        kw["type"] = meta.parse or (tp if tp in (int, float, str) else None)
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        kw["choices"] = [e.value for e in tp]
    elif meta.choices is not None:
        kw["choices"] = list(meta.choices)
    if meta.metavar:
        kw["metavar"] = meta.metavar
    return kw


def add_flags(parser: argparse.ArgumentParser, cls: type) -> list[FlagSpec]:
    """Add every flag of `cls` (nested configs included), one argument group per config
    class; returns the specs added."""
    added, groups = [], {}
    for s in specs(cls):
        if s.owner not in groups:
            groups[s.owner] = parser.add_argument_group(s.owner)
        groups[s.owner].add_argument(s.option, *s.flag.aliases, **argparse_kwargs(s))
        added.append(s)
    return added


def _value(s: FlagSpec, ns: argparse.Namespace) -> Any:
    value = getattr(ns, s.dest, s.default)  # a flag the parser lacks keeps its default
    tp = _optional(s.type)
    if typing.get_origin(tp) is tuple and s.flag.parse is None:
        return _split_values(value) if value is not None else s.default
    if isinstance(tp, type) and issubclass(tp, enum.Enum) and value is not None:
        return tp(value)
    return value


def build(cls: type, ns: argparse.Namespace, **overrides: Any) -> Any:
    """`cls` from parsed flags: flagged fields from `ns`, nested configs built the same way,
    other fields at their defaults; `overrides` (field name → value) win. Raises what the
    config's __post_init__ raises (ValueError for a bad value)."""
    hints = _hints(cls)
    kwargs: dict[str, Any] = {}
    by_name = {s.path[0]: s for s in specs(cls) if len(s.path) == 1}
    for f in dataclasses.fields(cls):
        if f.name in overrides or not f.init:
            continue
        if _is_config(hints[f.name]):
            kwargs[f.name] = build(hints[f.name], ns)
        elif f.name in by_name:
            kwargs[f.name] = _value(by_name[f.name], ns)
    return cls(**kwargs, **overrides)


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows each flag's default after its help, unless the help already says it."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if "default:" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


def parser_for(cls: type, prog: str, description: str) -> argparse.ArgumentParser:
    """A parser holding `cls`'s flags, every default shown in --help."""
    p = argparse.ArgumentParser(prog=prog, description=description,
                                formatter_class=HelpFormatter)
    add_flags(p, cls)
    return p

