"""A name -> class registry, the part of mmengine's ``Registry`` that chat templates use."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TypeVar

T = TypeVar("T", bound=type)


class UnknownNameError(KeyError):
    """A name nobody registered; the message lists the names that are."""

    def __str__(self) -> str:         # KeyError would print the message in quotes
        return str(self.args[0])


class Registry:
    def __init__(self, name: str):
        self.name = name
        self._classes: dict[str, type] = {}

    def register_module(self, name: str | None = None) -> Callable[[T], T]:
        """Class decorator; stack it to register one class under several names (aliases).
        Names are global keys, so registering one twice is an error."""

        def register(cls: T) -> T:
            key = name or cls.__name__
            if key in self._classes:
                raise ValueError(f"{key!r} is already registered in {self.name} (as {self._classes[key].__name__})")
            self._classes[key] = cls
            return cls

        return register

    def get(self, name: str) -> type:
        try:
            return self._classes[name]
        except KeyError:
            raise UnknownNameError(f"unknown {self.name} {name!r}; known: {', '.join(sorted(self._classes))}") from None

    def names(self) -> list[str]:
        return sorted(self._classes)

    def items(self) -> Iterator[tuple[str, type]]:
        return iter(self._classes.items())

    def __contains__(self, name: object) -> bool:
        return name in self._classes

    def __len__(self) -> int:
        return len(self._classes)
