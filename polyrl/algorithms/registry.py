"""A small name -> function registry, so ``algorithm.loss: gspo`` is one config line."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

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
        return sorted(self._items)

    def check(self, name: str, key: str) -> None:
        if name not in self._items:
            raise ValueError(f"{key}: unknown {self.kind} '{name}'; valid: {', '.join(self.names())}")

    def __getitem__(self, name: str) -> Callable:
        self.check(name, key=self.kind)
        return self._items[name]

    def __contains__(self, name: str) -> bool:
        return name in self._items
