"""Typed config loading: dataclasses with help text, built from YAML sections with clear errors."""
from __future__ import annotations

import dataclasses
import difflib
import os
import types
import typing
from collections.abc import Mapping
from typing import Any

import yaml


class ConfigError(ValueError):
    """A user-facing configuration error; the message names the file and the field."""


def help_field(default: Any, help: str, **kwargs) -> Any:
    """A dataclass field with help text (shown in errors and docs)."""
    if isinstance(default, (list, dict)):
        return dataclasses.field(default_factory=lambda: type(default)(default), metadata={"help": help}, **kwargs)
    return dataclasses.field(default=default, metadata={"help": help}, **kwargs)


def required_field(help: str) -> Any:
    """A dataclass field without a default (must be given)."""
    return dataclasses.field(metadata={"help": help})


def load_yaml(path: str | os.PathLike) -> dict:
    """Reads a YAML file into a dict; a missing file or bad YAML is a ConfigError naming the file."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise ConfigError(f"{path}: config file not found")
    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f)
    except yaml.YAMLError as err:
        raise ConfigError(f"{path}: not valid YAML: {err}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping at the top level, got {type(data).__name__}")
    return data


def get_section(data: Mapping, dotted: str, source: str, required: bool = True) -> dict:
    """Returns data['a']['b'] for dotted='a.b', with an error naming the missing key."""
    node: Any = data
    for part in dotted.split("."):
        if not isinstance(node, Mapping) or part not in node:
            if not required:
                return {}
            raise ConfigError(f"{source}: missing section '{dotted}'")
        node = node[part]
    if node is None:
        return {}
    if not isinstance(node, Mapping):
        raise ConfigError(f"{source}: section '{dotted}' must be a mapping, got {type(node).__name__}")
    return dict(node)


def _check_type(value: Any, annotation: Any) -> Any:
    """Coerces value to the annotated type where safe (int->float); raises TypeError otherwise."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(annotation)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _check_type(value, arg)
            except TypeError as err:
                errors.append(str(err))
        raise TypeError(" or ".join(errors))
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise TypeError(f"a list, got {type(value).__name__} {value!r}")
        (item_type, *_) = typing.get_args(annotation) or (Any,)
        return origin(_check_type(v, item_type) for v in value)
    if origin is dict or annotation is dict:
        if not isinstance(value, Mapping):
            raise TypeError(f"a mapping, got {type(value).__name__} {value!r}")
        return dict(value)
    if annotation is Any:
        return value
    if annotation is bool:
        if not isinstance(value, bool):
            raise TypeError(f"true/false, got {type(value).__name__} {value!r}")
        return value
    if annotation is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"an integer, got {type(value).__name__} {value!r}")
        return value
    if annotation is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            # YAML 1.1 reads "1e-6" (no dot) as a string; accept numeric strings.
            if isinstance(value, str):
                try:
                    return float(value)
                except ValueError:
                    pass
            raise TypeError(f"a number, got {type(value).__name__} {value!r}")
        return float(value)
    if annotation is str:
        if not isinstance(value, str):
            raise TypeError(f"a string, got {type(value).__name__} {value!r}")
        return value
    return value


def from_mapping(cls, values: Mapping, source: str, ignored_keys: frozenset = frozenset()):
    """Builds dataclass `cls` from a mapping, naming `source` and the field in every error.

    Unknown keys are an error (with a did-you-mean hint) unless listed in `ignored_keys`.
    """
    fields = {f.name: f for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(cls)
    unknown = [k for k in values if k not in fields and k not in ignored_keys]
    if unknown:
        msgs = []
        for key in unknown:
            close = difflib.get_close_matches(str(key), list(fields) + sorted(ignored_keys), n=1)
            msgs.append(f"'{key}'" + (f" (did you mean '{close[0]}'?)" if close else ""))
        raise ConfigError(f"{source}: unknown field(s) {', '.join(msgs)}; known fields: {', '.join(fields)}")
    kwargs = {}
    for name, value in values.items():
        if name not in fields:
            continue
        try:
            kwargs[name] = _check_type(value, hints[name])
        except TypeError as err:
            raise ConfigError(f"{source}: field '{name}' must be {err}") from None
    missing = [
        n for n, f in fields.items()
        if n not in kwargs and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    ]
    if missing:
        raise ConfigError(f"{source}: missing required field(s) {', '.join(missing)}")
    obj = cls(**kwargs)
    validate = getattr(obj, "validate", None)
    if validate is not None:
        try:
            validate()
        except ConfigError as err:
            raise ConfigError(f"{source}: {err}") from None
    return obj

