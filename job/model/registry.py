"""A small typed registry: name -> implementation, filled by decorators where each implementation is defined.

PBG keeps its operators and comparators in ``PluginRegistry`` objects (``torchbiggraph/plugin.py``):
each class registers itself under its config name, and the model looks the name up instead of
walking an ``if kind == ...`` chain. The same idea here, with one addition: a registry may be tied
to a tuple of *declared* names (``job.model.names``), and then refuses to register anything else.
The torch model and the numpy serving twin each have their own registries over the same
declarations, so the config's choices, the trainer and the archive reader cannot drift apart.

Pure Python on purpose: the archive reader (numpy only) and the config (no torch) use it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Generic, Optional, TypeVar

T = TypeVar("T")


class UnknownNameError(ValueError):
    """A name that no implementation is registered under; the message lists the choices."""


class Registry(Generic[T]):
    """Implementations of one kind of thing (``what``: "operator", "comparator", ...) by name."""

    def __init__(self, what: str, declared: Optional[Sequence[str]] = None) -> None:
        self.what = what
        self.declared: Optional[tuple[str, ...]] = tuple(declared) if declared is not None else None
        self._entries: dict[str, T] = {}

    def register(self, name: str) -> Callable[[T], T]:
        """Decorator registering a class or function under ``name``; returns it unchanged."""

        def decorate(implementation: T) -> T:
            if self.declared is not None and name not in self.declared:
                raise ValueError(f"{self.what} '{name}' is not declared (declared: {', '.join(self.declared)})")
            if name in self._entries:
                raise ValueError(f"{self.what} '{name}' is registered twice")
            self._entries[name] = implementation
            return implementation

        return decorate

    def get(self, name: str) -> T:
        """The implementation registered under ``name``; an unknown name raises UnknownNameError listing the choices."""
        try:
            return self._entries[name]
        except KeyError:
            raise UnknownNameError(
                f"unknown {self.what} '{name}' (expected one of {', '.join(self.names())})"
            ) from None

    def names(self) -> tuple[str, ...]:
        """Registered names, in declaration order where there is one (else in registration order)."""
        if self.declared is None:
            return tuple(self._entries)
        return tuple(name for name in self.declared if name in self._entries)

    def missing(self) -> tuple[str, ...]:
        """Declared names that nothing is registered under (empty when the registry is complete)."""
        return tuple(name for name in self.declared or () if name not in self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __len__(self) -> int:
        return len(self._entries)

    def __repr__(self) -> str:
        return f"Registry({self.what!r}, names={list(self.names())})"
