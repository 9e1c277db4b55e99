"""Build frozen config dataclasses from plain mappings (Hydra's resolved YAML), strictly.

The YAML under ``conf/`` holds every default; the dataclasses carry none. A key the YAML lacks is
an error, and so is a key the dataclass does not declare (the message lists the valid ones).
Stdlib only, so every package can build its own sub-config in its own process.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any, Literal, Union


class ConfigError(ValueError):
    pass


def build(cls: type, data: Any, where: str = "") -> Any:
    if not isinstance(data, dict):
        raise ConfigError(f"{where or cls.__name__}: want a mapping, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(data) - set(names))
    if unknown:
        raise ConfigError(f"{where or cls.__name__}: unknown key(s) {unknown}; valid: {names}")
    missing = [n for n in names if n not in data]
    if missing:
        raise ConfigError(f"{where or cls.__name__}: missing key(s) {missing} (defaults live in conf/)")
    kwargs = {n: _value(hints[n], data[n], f"{where}.{n}" if where else n) for n in names}
    obj = cls(**kwargs)
    check = getattr(obj, "check", None)
    if check is not None:
        try:
            check()
        except ValueError as exc:
            raise ConfigError(f"{where or cls.__name__}: {exc}") from None
    return obj


def _value(hint: Any, value: Any, where: str) -> Any:
    origin = typing.get_origin(hint)
    if dataclasses.is_dataclass(hint):
        return build(hint, value, where)
    if origin is Literal:
        if value not in typing.get_args(hint):
            raise ConfigError(f"{where}: want one of {list(typing.get_args(hint))}, got {value!r}")
        return value
    if origin in (Union, types.UnionType):
        args = typing.get_args(hint)
        if value is None and type(None) in args:
            return None
        choices = [a for a in args if a is not type(None)]
        if len(choices) > 1:  # a tagged union of config classes: `kind` picks one
            return _tagged(choices, value, where)
        return _value(choices[0], value, where)
    if origin is dict:
        key_hint, value_hint = typing.get_args(hint)
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: want a mapping, got {type(value).__name__}")
        return {_value(key_hint, k, f"{where}[{k!r}]"): _value(value_hint, v, f"{where}[{k!r}]")
                for k, v in value.items()}
    if origin in (list, tuple):
        (inner, *_) = typing.get_args(hint)
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where}: want a list, got {type(value).__name__}")
        return tuple(_value(inner, v, f"{where}[{i}]") for i, v in enumerate(value))
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{where}: want a number, got {value!r}")
        return float(value)
    if hint in (int, str, bool):
        if type(value) is not hint:
            raise ConfigError(f"{where}: want {hint.__name__}, got {value!r}")
        return value
    raise TypeError(f"typed_config: no rule for {hint!r} at {where}")


def _tagged(choices: list[Any], value: Any, where: str) -> Any:
    kinds = {}
    for cls in choices:
        kind_hint = typing.get_type_hints(cls).get("kind") if dataclasses.is_dataclass(cls) else None
        if typing.get_origin(kind_hint) is not Literal:
            raise TypeError(f"typed_config: {where}: union members need a `kind: Literal[...]` field")
        for k in typing.get_args(kind_hint):
            kinds[k] = cls
    kind = value.get("kind") if isinstance(value, dict) else None
    if kind not in kinds:
        raise ConfigError(f"{where}.kind: want one of {sorted(kinds)}, got {kind!r}")
    return build(kinds[kind], value, where)


def to_dict(obj: Any) -> Any:
    """The inverse of ``build``, for handing a sub-config to a child process as JSON."""
    if dataclasses.is_dataclass(obj):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, tuple):
        return [to_dict(v) for v in obj]
    if isinstance(obj, dict):
        return {k: to_dict(v) for k, v in obj.items()}
    return obj
