"""A tool's JSON schema from a plain Python function, as `transformers.utils.get_json_schema` writes it (what chat
templates take as `tools=`): the docstring's first part is the description, its Google-style `Args:` block describes
each parameter (an `(choices: [...])` at the end of one becomes an `enum`), the type hints give the types (`int`,
`float`, `str`, `bool`, `None`, `Any`, `list[X]`, `tuple[X, Y]`, `dict[str, X]`, unions, `Literal`, `Enum`
classes), a parameter without a default is required, and the return hint with the `Returns:` block is `return`.
"""
from __future__ import annotations

import enum
import inspect
import json
import re
import types
import typing
from collections.abc import Callable

_DESCRIPTION = re.compile(r"^(.*?)[\n\s]*(Args:|Returns:|Raises:|\Z)", re.DOTALL)
_ARGS = re.compile(r"\n\s*Args:\n(.*?)[\n\s]*(Returns:|Raises:|\Z)", re.DOTALL)
_RETURNS = re.compile(r"\n\s*Returns:\n\s*(.*?)[\n\s]*(Raises:|\Z)", re.DOTALL)
# one `name: description` entry; a description's further lines are indented deeper than its name
_ARG_ENTRY = re.compile(r"(?:^|\n)([ \t]*)(\w+):\s*(.*?)\s*(?=\n(?!\1[ \t])[ \t]*\w+:|\Z)", re.DOTALL)
_CHOICES = re.compile(r"\(choices:\s*(.*?)\)\s*$", re.IGNORECASE)
_SCALARS = {int: "integer", float: "number", str: "string", bool: "boolean", type(None): "null"}
_BARE = {**{t: {"type": name} for t, name in _SCALARS.items()}, list: {"type": "array"}, tuple: {"type": "array"},
         dict: {"type": "object"}, typing.Any: {}}


class ToolDefinitionError(ValueError):
    """A tool function that cannot be described to the model (a missing hint, docstring or parameter description)."""


def function_schema(fn: Callable) -> dict:
    """`{"type": "function", "function": {name, description, parameters[, return]}}` of `fn`."""
    name = getattr(fn, "__name__", "operation")
    doc = inspect.getdoc(fn)
    if not doc:
        raise ToolDefinitionError(f"tool {name}: no docstring (its first lines describe the tool to the model)")
    description, arg_docs, returns = _parse_docstring(doc.strip())
    parameters, return_schema = _parameters(fn, name)
    for arg, schema in parameters["properties"].items():
        if arg not in arg_docs:
            raise ToolDefinitionError(f"tool {name}: the docstring's Args: block does not describe parameter '{arg}'")
        text = arg_docs[arg]
        choices = _CHOICES.search(text)
        if choices:
            schema["enum"] = [c.strip() if isinstance(c, str) else c for c in json.loads(choices.group(1))]
            text = text[:choices.start()].strip()
        schema["description"] = text
    function = {"name": name, "description": description, "parameters": parameters}
    if return_schema is not None:
        if returns is not None:
            return_schema["description"] = returns
        function["return"] = return_schema
    return {"type": "function", "function": function}


def _parse_docstring(doc: str) -> tuple[str | None, dict[str, str], str | None]:
    description, args, returns = _DESCRIPTION.search(doc), _ARGS.search(doc), _RETURNS.search(doc)
    arg_docs = {}
    if args:
        block = "\n".join(line for line in args.group(1).split("\n") if line.strip())
        arg_docs = {m[1]: re.sub(r"\s*\n+\s*", " ", m[2].strip()) for m in _ARG_ENTRY.findall(block)}
    return (description.group(1).strip() if description else None, arg_docs,
            returns.group(1).strip() if returns else None)


def _parameters(fn: Callable, name: str) -> tuple[dict, dict | None]:
    """The parameters' object schema and the return value's schema (None without a convertible return hint)."""
    signature = inspect.signature(fn)
    hints = typing.get_type_hints(fn)
    params = list(signature.parameters.values())
    if params and params[0].name in ("self", "cls") and params[0].annotation is inspect.Parameter.empty:
        params = params[1:]  # a method's receiver
    properties, required = {}, []
    for param in params:
        if param.annotation is inspect.Parameter.empty:
            raise ToolDefinitionError(f"tool {name}: parameter '{param.name}' has no type hint")
        properties[param.name] = _type_schema(hints[param.name], name)
        if param.default is inspect.Parameter.empty:
            required.append(param.name)
    return_schema = None
    if "return" in hints:
        try:
            return_schema = _type_schema(hints["return"], name)
        except ToolDefinitionError:
            pass  # the model never writes the return value: an unconvertible hint only leaves it undescribed
    parameters = {"type": "object", "properties": properties}
    if required:
        parameters["required"] = required
    return parameters, return_schema


def _enum_schema(values: list, name: str) -> dict:
    if not values or any(type(v) not in _SCALARS for v in values):
        raise ToolDefinitionError(f"tool {name}: choices {values!r} are not JSON scalars")
    kinds = list(dict.fromkeys(_SCALARS[type(v)] for v in values))
    return {"type": kinds[0] if len(kinds) == 1 else kinds, "enum": values}


def _type_schema(hint, name: str) -> dict:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is None:
        if isinstance(hint, type) and issubclass(hint, enum.Enum):
            return _enum_schema([member.value for member in hint], name)
        if hint in _BARE:
            return dict(_BARE[hint])
        raise ToolDefinitionError(f"tool {name}: type hint {hint!r} has no JSON schema (use int, float, str, bool, "
                                  "Literal, Enum, or list / tuple / dict / unions of them)")
    if origin is typing.Union or origin is types.UnionType:
        subtypes = [_type_schema(t, name) for t in args if t is not type(None)]
        if len(subtypes) == 1:
            schema = subtypes[0]
        elif all(s.keys() == {"type"} and isinstance(s["type"], str) for s in subtypes):
            kinds = sorted({s["type"] for s in subtypes})
            schema = {"type": kinds[0] if len(kinds) == 1 else kinds}
        else:
            schema = {"anyOf": subtypes}
        if type(None) in args:
            schema["nullable"] = True
        return schema
    if origin is typing.Literal and args:
        return _enum_schema(list(args), name)
    if origin is list:
        return {"type": "array", "items": _type_schema(args[0], name)} if args else {"type": "array"}
    if origin is tuple:
        if len(args) == 1 or ... in args:
            raise ToolDefinitionError(f"tool {name}: {hint} is not a fixed tuple of two or more items (use list[])")
        return {"type": "array", "prefixItems": [_type_schema(t, name) for t in args]} if args else {"type": "array"}
    if origin is dict:
        return {"type": "object", "additionalProperties": _type_schema(args[1], name)} if len(args) == 2 else \
            {"type": "object"}
    raise ToolDefinitionError(f"tool {name}: type hint {hint!r} has no JSON schema")
