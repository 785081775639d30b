"""Command-line flags generated from the `GRPOConfig` fields, and one-line errors for every CLI."""
from __future__ import annotations

import argparse
import dataclasses
import difflib
import types
import typing
from collections.abc import Iterable
from typing import Any

from mindrlhf.configs.grpo_configs import (
    PLAIN_FLAG_SECTION,
    SECTIONS,
    GRPOConfig,
    field_paths,
)

_DEST_PREFIX = "cfg__"
_SHARED_PREFIX = "cfg_shared__"


def parse_bool(text: str) -> bool:
    """true/false (any case: MindRLHF's tutorials write True / False), 1/0, yes/no."""
    lowered = text.strip().lower()
    if lowered in ("true", "1", "yes"):
        return True
    if lowered in ("false", "0", "no"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


class OneLineErrorParser(argparse.ArgumentParser):
    """An `ArgumentParser` whose usage errors are one line, `prog: error: <problem>` (with a did-you-mean for a
    mistyped flag), and a pointer to `--help`, exit code 2, instead of the whole usage first. Flags are matched
    exactly (`--num_generation` is not taken for `--num_generations`)."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> typing.NoReturn:
        hint = did_you_mean(message, self._option_string_actions)
        self.exit(2, f"{self.prog}: error: {message}{hint}\nsee {self.prog} --help\n")


def did_you_mean(message: str, flags: Iterable[str]) -> str:
    """` (did you mean --x?)` for the flags argparse's "unrecognized arguments: ..." `message` names that are close
    to one of `flags`; empty for any other message or when nothing is close."""
    if not message.startswith("unrecognized arguments:"):
        return ""
    known = [flag for flag in flags if flag.startswith("--")]
    guesses = []
    for word in message.split(":", 1)[1].split():
        if word.startswith("--"):
            close = difflib.get_close_matches(word.split("=", 1)[0], known, n=1)
            guesses += [close[0]] if close else []
    return f" (did you mean {' or '.join(guesses)}?)" if guesses else ""


def type_metavar(annotation: Any) -> str:
    """What a flag's value looks like in --help: INT, FLOAT, STR (a list's item type), {true,false}."""
    annotation = _without_none(annotation)
    if typing.get_origin(annotation) in (list, tuple):
        annotation = (typing.get_args(annotation) or (str,))[0]
    if annotation is bool:
        return "{true,false}"
    return annotation.__name__.upper() if annotation in (int, float, str) else "STR"


def default_text(value: Any) -> str:
    """A default as it would be typed on the command line (`none` for an empty string or list)."""
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (list, tuple)):
        return " ".join(map(str, value)) or "none"
    return "none" if value is None or value == "" else str(value)


def flag_help(help: str, field: dataclasses.Field | None, default: Any) -> str:
    """`help` ending with `(default: ...)`: the field's `shown_default` metadata if any (a default that is
    resolved later, e.g. from the tokenizer), else `default`; `%` escaped for argparse."""
    shown = field.metadata.get("shown_default") if field is not None else None
    text = f"{help} (default: {shown or default_text(default)})"
    return text.replace("%", "%%")


def _without_none(annotation: Any) -> Any:
    """`X` of `X | None`; other annotations unchanged."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        args = [arg for arg in typing.get_args(annotation) if arg is not type(None)]
        return args[0] if len(args) == 1 else annotation
    return annotation


def _flag_kwargs(annotation: Any) -> dict:
    annotation = _without_none(annotation)
    metavar = type_metavar(annotation)
    if typing.get_origin(annotation) in (list, tuple):
        (item,) = typing.get_args(annotation)[:1] or (str,)
        return {"nargs": "*", "type": item if item in (int, float, str) else str, "metavar": metavar}
    if annotation is bool:
        return {"type": parse_bool, "metavar": metavar}
    if annotation in (int, float, str):
        return {"type": annotation, "metavar": metavar}
    return {"type": str, "metavar": metavar}


def add_config_flags(parser: argparse.ArgumentParser) -> None:
    """Adds one flag per GRPOConfig field, `--section.name`, and `--name`: for a name that several sections
    share (`seed`), `--name` sets it in all of them and `--section.name` in one (and wins), unless
    `PLAIN_FLAG_SECTION` gives `--name` to one section (`--learning_rate`: the optimizer's)."""
    hints = {section: typing.get_type_hints(cls) for section, cls in SECTIONS.items()}
    defaults = GRPOConfig()  # its generation section has defaults of its own (max_new_tokens, prompt_buckets)
    for name, places in field_paths().items():
        owner = places[0][0] if len(places) == 1 else PLAIN_FLAG_SECTION.get(name)
        values = [getattr(getattr(defaults, section), name) for section, _ in places]
        if owner is None:
            sections = ", ".join(section for section, _ in places)
            shared_help = f"[{sections}] sets {name} in each of these sections"
            if all(value == values[0] for value in values):
                shared_help = flag_help(shared_help, places[0][1], values[0])
            parser.add_argument(f"--{name}", dest=f"{_SHARED_PREFIX}{name}", default=None, help=shared_help,
                                **_flag_kwargs(hints[places[0][0]][name]))
        for (section, field), value in zip(places, values):
            flags = [f"--{section}.{name}"]
            if section == owner:
                flags.insert(0, f"--{name}")
            parser.add_argument(*flags, dest=f"{_DEST_PREFIX}{section}__{name}", default=None,
                                help=flag_help(f"[{section}] {field.metadata.get('help', '')}", field, value),
                                **_flag_kwargs(hints[section][name]))


def config_overrides(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """`{section: {field: value}}` of the config flags given on the command line."""
    overrides: dict[str, dict[str, Any]] = {}
    places = field_paths()
    for dest, value in vars(args).items():
        if dest.startswith(_SHARED_PREFIX) and value is not None:
            name = dest[len(_SHARED_PREFIX):]
            for section, _ in places[name]:
                overrides.setdefault(section, {})[name] = value
    for dest, value in vars(args).items():
        if not dest.startswith(_DEST_PREFIX) or value is None:
            continue
        section, name = dest[len(_DEST_PREFIX):].split("__", 1)
        overrides.setdefault(section, {})[name] = value
    return overrides


def section_field_names() -> dict[str, list[str]]:
    """Section -> its field names (for docs and tests)."""
    return {section: [f.name for f in dataclasses.fields(cls)] for section, cls in SECTIONS.items()}
