"""Typed config loading: dataclasses with help text, built from YAML sections with clear errors."""
from __future__ import annotations

import dataclasses
import difflib
import os
import types
import typing
from collections.abc import Iterable, Mapping
from typing import Any

import yaml


class ConfigError(ValueError):
    """A user-facing configuration error; the message names the file and the field."""


class Validated:
    """Base of a config dataclass that checks itself as it is made: `validate` runs in `__post_init__`, so once per
    value, whether the value is built in code, by `from_mapping` (a YAML section, flags) or by `dataclasses.replace`
    (the way to change a frozen config: `@dataclass(frozen=True)` refuses assignment). Code handed such a config
    trusts it and does not validate it again; what depends on a network (vocabulary, sequence length) is checked
    where the network is known."""

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raises ConfigError naming the field when a value is out of range (none here: a section without checks)."""


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


def one_edit_apart(a: str, b: str) -> bool:
    """Whether `b` is `a` with one character inserted, deleted or replaced, or two neighbours swapped."""
    if a == b or abs(len(a) - len(b)) > 1:
        return False
    if len(a) > len(b):
        a, b = b, a
    start = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
    if len(a) < len(b):
        return a[start:] == b[start + 1:]
    swapped = a[start:start + 2] == b[start:start + 2][::-1] and a[start + 2:] == b[start + 2:]
    return a[start + 1:] == b[start + 1:] or swapped


def closest_key(key: Any, known: Iterable[str], one_edit: bool = False) -> str | None:
    """The known key a did-you-mean hint names for `key`: one within one edit of it (`one_edit_apart`) when there is
    one, else (unless `one_edit`) difflib's closest match; None when nothing is close."""
    key, known = str(key), list(known)
    near = [name for name in known if one_edit_apart(key, name)]
    if near or one_edit:
        return (difflib.get_close_matches(key, near, n=1, cutoff=0) or [None])[0]
    close = difflib.get_close_matches(key, known, n=1)
    return close[0] if close else None


def _unknown_key_hint(key: Any, known: list[str], elsewhere: Mapping[str, Iterable[str]]) -> str:
    """What an unknown field's error adds: the other sections (of `elsewhere`: section -> its field names) that
    have a field of that very name, else a did-you-mean naming the closest of `known` and the other sections'
    fields (`section.name` for one of another section); empty when nothing is close."""
    key = str(key)
    owners = [section for section, names in elsewhere.items() if key in names]
    if owners:
        return f" ({' and '.join(owners)} {'has' if len(owners) == 1 else 'have'} a field '{key}')"
    others = {}
    for section, names in elsewhere.items():
        for name in names:
            others.setdefault(name, section)
    close = closest_key(key, known + [name for name in others if name not in known])
    if close is None:
        return ""
    return f" (did you mean '{close}'?)" if close in known else f" (did you mean '{others[close]}.{close}'?)"


def from_mapping(cls, values: Mapping, source: str, ignored_keys: frozenset = frozenset(),
                 elsewhere: Mapping[str, Iterable[str]] | None = None):
    """Builds dataclass `cls` from a mapping, naming `source` and the field in every error.

    Unknown keys are an error (with a did-you-mean hint) unless listed in `ignored_keys`; `elsewhere` (section ->
    its field names) are the fields of the other sections of the file, which the hint also names (a field put in
    the wrong section). The object is validated once: by its own `__post_init__` (a `Validated` config), else by
    its `validate` method when it has one.
    """
    fields = {f.name: f for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(cls)
    unknown = [k for k in values if k not in fields and k not in ignored_keys]
    if unknown:
        known = list(fields) + sorted(ignored_keys)
        msgs = [f"'{key}'" + _unknown_key_hint(key, known, elsewhere or {}) for key in unknown]
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
    try:
        obj = cls(**kwargs)  # a `Validated` config validates itself here
        if not isinstance(obj, Validated) and hasattr(obj, "validate"):
            obj.validate()  # a mutable config (a model YAML's): checked as it is read
    except ConfigError as err:
        raise ConfigError(f"{source}: {err}") from None
    return obj

