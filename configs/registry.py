"""One registry of named plug-ins, shared by every kind the config selects by name: pipeline
schedules (`pipeline.schedule`), attention kernels (`model.attention`), corpus formats and
objectives (`train.objective`). A plug-in is a class with a `name`, decorated with `register`;
an unknown name is one `ConfigError` line naming the key and the choices.
"""

from __future__ import annotations

from typing import Any, Callable, Generic, TypeVar

from configs.schema import ConfigError

T = TypeVar("T")
C = TypeVar("C", bound=type)


class Registry(Generic[T]):
    """Plug-ins of one kind by name, in the order registered: an instance of each class
    (`instances`, the default) or the classes themselves."""

    def __init__(self, key: str, instances: bool = True, unknown: str = "{key}: {name!r} is not one of {names}"):
        self.key, self.instances, self.unknown = key, instances, unknown
        self.entries: dict[str, Any] = {}

    def register(self, cls: C) -> C:
        """Class decorator: makes `key=cls.name` select `cls`."""
        if cls.name in self.entries:
            raise ValueError(f"{self.key}: {cls.name} registered twice")
        self.entries[cls.name] = cls() if self.instances else cls
        return cls

    def get(self, name: str) -> T:
        """The plug-in called `name`. Raises ConfigError naming the key for an unknown one."""
        if name not in self.entries:
            raise ConfigError(self.unknown.format(key=self.key, name=name, names=", ".join(self.entries)))
        return self.entries[name]

    def names(self) -> tuple[str, ...]:
        return tuple(self.entries)

    def values(self) -> list[T]:
        return list(self.entries.values())


def api(registry: Registry) -> tuple[Callable, Callable, Callable]:
    """The (register, get, names) functions a package exports for its registry."""
    return registry.register, registry.get, registry.names
