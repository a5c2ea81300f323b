"""Name -> implementation tables behind `algo=`, `task=`, baselines, losses and joint modes, and the
config schemas of the `algo` and `task` options (light on purpose: no torch, no Hydra)."""

from __future__ import annotations

from typing import Callable, TypeVar

T = TypeVar("T")

# Config group -> option name -> the option's dataclass schema, filled by `@register_algorithm(name,
# schema=...)` and `@register_task(name, schema=...)`; marl_llm.configure stores each in Hydra's
# ConfigStore as `<group>/<name>_schema`, which the option's YAML names first in its defaults list.
SCHEMAS: dict[str, dict[str, type]] = {"algo": {}, "task": {}}


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


def schema_registrar(table: dict[str, T], kind: str, group: str) -> Callable[..., Callable[[T], T]]:
    """Like `registrar`, for an option of a config group: `@register("name", schema=Dataclass)` also
    records the option's config schema (a dataclass; its optional `check(cfg)` staticmethod checks
    the values that types cannot when a config is validated)."""
    register = registrar(table, kind)

    def register_with_schema(name: str, schema: type | None = None) -> Callable[[T], T]:
        def decorator(obj: T) -> T:
            registered = register(name)(obj)  # refuses a second object under the name
            if schema is not None:
                SCHEMAS[group][name] = schema
            return registered

        return decorator

    return register_with_schema
