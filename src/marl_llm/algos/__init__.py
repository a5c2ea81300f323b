"""RL algorithms and their pieces: advantage estimators (`advantages`), policy losses (`losses`),
the Algorithm interface (`base`), the built-ins' config schemas (`schemas`). An algorithm is a
module that registers an Algorithm (`@register_algorithm`) plus a YAML; a built-in is also
declared in `schemas` (with its schema), so that a config is checked without importing torch.

The names below load `base` (torch) on first use: importing `marl_llm.algos.schemas` stays light."""

from __future__ import annotations

from typing import Any

from marl_llm.registry import ALGORITHMS

__all__ = ["ALGORITHMS", "AgentBatch", "Algorithm", "algorithm_class", "build_algorithm", "register_algorithm"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from marl_llm.algos import base

        return getattr(base, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
