"""The one registry helper: a named family of functions (advantage estimators, objectives, aggregations, KL
estimators, reward functions, tool-call formats, example tasks), each family's names written once, at its
`register` calls. The config validates its choices against them (schemas/config.py, `registered`) and the config
reference lists them. An entry's capabilities are a typed dataclass of its family, so code asks an entry what it
needs (`needs_critic`, `keeps_prompt_state`) instead of testing its name, and a misspelled capability fails at
import instead of reading as False."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Generic, Iterator, TypeVar

from schemas.errors import UserError

F = TypeVar("F", bound=Callable)


class RegistryError(UserError, KeyError):
    def __str__(self) -> str:  # KeyError would quote the message
        return self.args[0]


@dataclass(frozen=True)
class NoCapabilities:
    """A family whose entries differ only in their function."""


@dataclass(frozen=True)
class Entry(Generic[F]):
    name: str
    fn: F
    capabilities: Any  # the family's capabilities dataclass

    def __getattr__(self, key: str) -> Any:
        """A capability by attribute (`entry.needs_critic`); one the family does not have is an AttributeError."""
        if key.startswith("__"):
            raise AttributeError(key)
        return getattr(self.capabilities, key)


class Registry(Generic[F]):
    def __init__(self, family: str, capabilities: type = NoCapabilities):
        self.family = family
        self.capabilities = capabilities
        self._entries: dict[str, Entry[F]] = {}

    def register(self, name: str, **capabilities: Any) -> Callable[[F], F]:
        """Decorator: add `fn` under `name` with its capabilities (the family's dataclass: an unknown one is a
        TypeError); a second entry under one name is a bug, refused at import."""
        caps = self.capabilities(**capabilities)

        def wrap(fn: F) -> F:
            if name in self._entries:
                raise ValueError(f"{self.family} {name!r} is registered twice")
            self._entries[name] = Entry(name, fn, caps)
            return fn

        return wrap

    def entry(self, name: str) -> Entry[F]:
        try:
            return self._entries[name]
        except KeyError:
            raise RegistryError(f"unknown {self.family} {name!r}: choose one of {', '.join(self.names())}") from None

    def get(self, name: str) -> F:
        return self.entry(name).fn

    __getitem__ = get

    def names(self) -> list[str]:
        return sorted(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())
