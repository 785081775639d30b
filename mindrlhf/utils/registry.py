"""Tiny name -> function registries (the verl `core_algos` style): variants are chosen by name from config."""
from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar

F = TypeVar("F", bound=Callable)


class Registry(Generic[F]):
    """A named set of interchangeable functions; unknown names fail with the list of known ones."""

    def __init__(self, kind: str):
        self.kind = kind
        self._entries: dict[str, F] = {}

    def register(self, name: str) -> Callable[[F], F]:
        """Decorator registering `fn` under `name`; registering a name twice is an error."""

        def decorator(fn: F) -> F:
            if name in self._entries:
                raise ValueError(f"{self.kind} {name!r} is already registered")
            self._entries[name] = fn
            return fn

        return decorator

    def get(self, name: str) -> F:
        """The function registered as `name`; a ValueError naming the known choices otherwise."""
        if not isinstance(name, str) or name not in self._entries:
            raise ValueError(f"unknown {self.kind} {name!r}; expected one of {sorted(self._entries)}")
        return self._entries[name]

    def names(self) -> tuple[str, ...]:
        return tuple(sorted(self._entries))

    def __contains__(self, name: object) -> bool:
        return name in self._entries
