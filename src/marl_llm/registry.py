"""Name -> implementation tables behind `algo=`, `task=`, baselines, losses, aggregations and joint
modes, and the config schemas of the `algo` and `task` options (light on purpose: no torch, no
Hydra).

Composing and checking a config needs only the names, the schemas and a little metadata, not the
implementations, which import torch and transformers (seconds). So a built-in whose module is
heavy is *declared* by name and module (`Registry.declare`, in algos/schemas.py, beside its schema):
its module is imported when the object is first looked up, and its own `@register_*` decorator
fills the entry in. Names, `in` and `sorted(table)` never import. A plugin's decorators register
directly, as always.

The decorators a plugin registers a baseline, joint mode, policy loss or aggregation with, and the
`Surrogate` a loss returns, are here too, so that such a plugin imports no torch: marl-llm imports
every plugin to compose a config, `--help` and a typo included (docs/extending.md).
algos/advantages.py and algos/losses.py, which hold the built-ins, re-export them.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator, MutableMapping
from typing import TYPE_CHECKING, Callable, Generic, NamedTuple, TypeVar

if TYPE_CHECKING:
    from torch import Tensor

T = TypeVar("T")


class Declared:
    """An entry not yet imported: the module whose decorator registers it."""

    def __init__(self, module: str):
        self.module = module

    def __repr__(self) -> str:
        return f"<declared in {self.module}>"


class Registry(MutableMapping[str, T], Generic[T]):
    """name -> object, entries either registered or declared (imported on first lookup)."""

    def __init__(self, kind: str):
        self.kind = kind
        self._entries: dict[str, T | Declared] = {}

    def declare(self, name: str, module: str) -> None:
        """`name` is registered by `module` (a decorator there), imported when first looked up (a
        module imported before the declaration has registered it already: kept)."""
        entry = self._entries.get(name)
        if entry is None:
            self._entries[name] = Declared(module)
        elif getattr(entry, "module" if isinstance(entry, Declared) else "__module__", None) != module:
            raise ValueError(f"{self.kind} {name!r} is already registered")

    def __getitem__(self, name: str) -> T:
        entry = self._entries[name]
        if isinstance(entry, Declared):
            importlib.import_module(entry.module)
            entry = self._entries[name]
            if isinstance(entry, Declared):
                raise LookupError(f"{entry.module} was declared to register the {self.kind} {name!r} but did not")
        return entry

    def __setitem__(self, name: str, obj: T) -> None:
        """Registration: a new name, or the declared name of an object defined in the declared module."""
        entry = self._entries.get(name)
        if entry is not None and not (isinstance(entry, Declared) and entry.module == getattr(obj, "__module__", None)):
            raise ValueError(f"{self.kind} {name!r} is already registered")
        self._entries[name] = obj

    def __delitem__(self, name: str) -> None:
        del self._entries[name]

    def __contains__(self, name: object) -> bool:  # no import (Mapping's would look the entry up)
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def __repr__(self) -> str:
        return f"Registry({self.kind}: {self._entries!r})"


# Config group -> option name -> the option's dataclass schema, filled by `@register_algorithm(name,
# schema=...)` and `@register_task(name, schema=...)` (and the declarations of algos/schemas.py);
# marl_llm.configure stores each in Hydra's ConfigStore as `<group>/<name>_schema`, which the
# option's YAML names first in its defaults list.
SCHEMAS: dict[str, dict[str, type]] = {"algo": {}, "task": {}}

# The tables (their decorators are below, register_algorithm's in algos/base.py; the functions that
# use them live with the implementations: algos/base.py, algos/advantages.py, algos/losses.py).
ALGORITHMS: Registry = Registry("algorithm")
BASELINES: Registry = Registry("baseline")
# Smallest group a baseline is defined on; dense `group_advantages` enforces it.
BASELINE_MIN_GROUP_SIZE: dict[str, int] = {}
# Baselines that subtract a statistic of the sibling group: a group of one gets advantage 0 from
# them, so config validation asks for algo.num_generations >= 2 (raw, which ignores the group, not).
GROUP_BASELINES: set[str] = set()
JOINT_MODES: Registry = Registry("joint mode")
POLICY_LOSSES: Registry = Registry("policy loss")
AGGREGATIONS: Registry = Registry("aggregation")


def registrar(table: MutableMapping[str, T], kind: str) -> Callable[[str], Callable[[T], T]]:
    """`register = registrar(TABLE, "policy loss")`; then `@register("name")` adds the decorated
    object to TABLE under "name" (a second object under the same name is refused)."""

    def register(name: str) -> Callable[[T], T]:
        def decorator(obj: T) -> T:
            if isinstance(table, Registry):
                table[name] = obj  # refuses a taken name (a declared one: only from its module)
            elif name in table:
                raise ValueError(f"{kind} {name!r} is already registered")
            else:
                table[name] = obj
            return obj

        return decorator

    return register


def schema_registrar(table: MutableMapping[str, T], kind: str, group: str) -> Callable[..., Callable[[T], T]]:
    """Like `registrar`, for an option of a config group: `@register("name", schema=Dataclass)` also
    records the option's config schema (a dataclass; its optional `check(cfg)` staticmethod checks
    the values that types cannot when a config is validated, and `agents_for(task_agents)`, where
    the algorithm changes who plays, the agents it plays with)."""
    register = registrar(table, kind)

    def register_with_schema(name: str, schema: type | None = None) -> Callable[[T], T]:
        def decorator(obj: T) -> T:
            declared = SCHEMAS[group].get(name)
            registered = register(name)(obj)  # refuses a second object under the name (not a declared one)
            if schema is not None:
                if declared is not None and declared is not schema:
                    raise ValueError(f"{kind} {name!r} is declared with the schema {declared.__name__}, "
                                     f"registered with {schema.__name__}")
                SCHEMAS[group][name] = schema
            return registered

        return decorator

    return register_with_schema


def declare_option(table: Registry, group: str, name: str, module: str, schema: type) -> None:
    """A built-in option whose module is heavy: its name and schema now, its module on first use."""
    table.declare(name, module)
    if SCHEMAS[group].setdefault(name, schema) is not schema:
        raise ValueError(f"{table.kind} {name!r} is registered with the schema {SCHEMAS[group][name].__name__}, "
                         f"declared with {schema.__name__}")


def declare_baseline(name: str, module: str, min_group_size: int = 1, uses_group: bool = True) -> None:
    """A built-in baseline: its name and what config checks need (advantages.register_baseline's
    arguments, which must agree) now, its module on first use."""
    registered = name in BASELINES
    BASELINES.declare(name, module)
    if registered and (BASELINE_MIN_GROUP_SIZE.get(name), name in GROUP_BASELINES) != (min_group_size, uses_group):
        raise ValueError(f"baseline {name!r} is registered with other settings than it is declared with")
    BASELINE_MIN_GROUP_SIZE[name] = min_group_size
    if uses_group:
        GROUP_BASELINES.add(name)


# ------------------------------------------------------------------ what plugins register with
def register_baseline(name: str, *, min_group_size: int = 1, uses_group: bool = True) -> Callable[[T], T]:
    """Register ``fn(values: Tensor[n], groups: GroupIndex) -> Tensor[n]`` (advantages before
    normalization; algos/advantages.py) under ``name``, chosen with ``algo.baseline=<name>``.
    ``min_group_size``: the smallest group it is defined on; ``uses_group``: whether it subtracts a
    statistic of the group (then G >= 2 is required)."""

    def decorator(fn: T) -> T:
        if name in BASELINES and (BASELINE_MIN_GROUP_SIZE.get(name), name in GROUP_BASELINES) != (min_group_size,
                                                                                                  uses_group):
            raise ValueError(f"baseline {name!r} is declared with other settings than it is registered with")
        registrar(BASELINES, "baseline")(name)(fn)
        BASELINE_MIN_GROUP_SIZE[name] = min_group_size
        if uses_group:
            GROUP_BASELINES.add(name)
        return fn

    return decorator


# ``fn(joint_returns, num_agents) -> per-agent returns Tensor[(B,) N, G]``, algo.joint_mode=<name>.
register_joint_mode = registrar(JOINT_MODES, "joint mode")
# A per-token surrogate ``fn(logp, old_logp, advantages, eps_low, eps_high) -> Surrogate``, algo.loss_type=<name>.
register_loss = registrar(POLICY_LOSSES, "policy loss")
# ``fn(per_token [B, T], mask [B, T] bool) -> scalar``, algo.loss_aggregation=<name>.
register_aggregation = registrar(AGGREGATIONS, "aggregation")


class Surrogate(NamedTuple):
    """Output of a registered per-token loss; every field is [B, T]."""

    loss: Tensor  # per-token loss to aggregate (to minimize)
    ratio: Tensor  # importance ratio exp(logp - old_logp)
    clipped_low: Tensor  # bool: clipped on the low side (r < 1 - eps_low and A < 0)
    clipped_high: Tensor  # bool: clipped on the high side (r > 1 + eps_high and A > 0)
