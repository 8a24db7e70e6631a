"""A small name -> function registry, so ``algorithm.loss: gspo`` is one config line; ``module:attr`` names a
function of the user's own."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from polyrl.loader import is_reference, load_object

F = TypeVar("F", bound=Callable)


class Registry:
    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._items: dict[str, Callable] = {}

    def register(self, name: str) -> Callable[[F], F]:
        """Decorator: ``@LOSSES.register("my_loss")`` makes ``algorithm.loss: my_loss`` valid."""

        def wrap(fn: F) -> F:
            if name in self._items:
                raise ValueError(f"{self.kind} '{name}' is already registered")
            self._items[name] = fn
            return fn

        return wrap

    def names(self) -> list[str]:
        return sorted(n for n in self._items if not is_reference(n))

    def check(self, name: str, key: str) -> None:
        """``name`` is registered, or a ``module:attr`` reference to the user's own function (imported from the
        working directory and registered under that reference)."""
        if name not in self._items and is_reference(name):
            fn = load_object(name, key)
            if not callable(fn):
                raise ValueError(f"{key}: '{name}' is not callable; it must be a {self.kind} function")
            self._items[name] = fn
        if name not in self._items:
            raise ValueError(f"{key}: unknown {self.kind} '{name}'; valid: {', '.join(self.names())}, or "
                             "module:attr")

    def __getitem__(self, name: str) -> Callable:
        self.check(name, key=self.kind)
        return self._items[name]

    def __contains__(self, name: str) -> bool:
        return name in self._items
