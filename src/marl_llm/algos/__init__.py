"""RL algorithms and their pieces: advantage estimators (`advantages`), policy losses (`losses`),
the Algorithm interface (`base`). Every module here that registers an Algorithm
(`@register_algorithm`) is found by `build_algorithm`: adding one is a module plus a YAML."""

from marl_llm.algos.base import (ALGORITHMS, AgentBatch, Algorithm, algorithm_class, build_algorithm,
                                 register_algorithm)

__all__ = ["ALGORITHMS", "AgentBatch", "Algorithm", "algorithm_class", "build_algorithm", "register_algorithm"]
