"""Name → implementation tables behind `algo=`, `task=`, baselines, losses and joint modes."""

from __future__ import annotations

from typing import Callable, TypeVar

T = TypeVar("T")


def registrar(table: dict[str, T], kind: str) -> Callable[[str], Callable[[T], T]]:
    """`register = registrar(TABLE, "policy loss")`; then `@register("name")` adds the decorated
    object to TABLE under "name" (a second object under the same name is refused)."""

    def register(name: str) -> Callable[[T], T]:
        def decorator(obj: T) -> T:
            if name in table:
                raise ValueError(f"{kind} {name!r} is already registered")
            table[name] = obj
            return obj

        return decorator

    return register
