"""The task metrics as Hugging Face `evaluate` modules, loaded offline from this package.

    from marl_llm import metrics
    writing = metrics.load("writing_reward", "tldr")      # or "arxiv": that task's bands
    writing.compute(first=["short summary ..."], second=["longer summary ..."])
    pass_k = metrics.load("pass_at_k")
    pass_k.compute(predictions=[[program, ...]], references=[test_code], entry_points=["f"], k=[1, 5])

`evaluate.load(metrics.path(name))` works the same way. The scores are those the trainer logs
(marl_llm.tasks.writing_reward, marl_llm.training.evaluation.pass_at_k); programs run in the sandbox.
"""

from __future__ import annotations

from importlib import resources
from typing import Any

NAMES = ("writing_reward", "pass_at_k")


def path(name: str) -> str:
    """The directory of metric `name` (evaluate.load accepts it as a local path)."""
    if name not in NAMES:
        raise ValueError(f"unknown metric {name!r}; available: {', '.join(NAMES)}")
    return str(resources.files("marl_llm.metrics").joinpath(name))


def load(name: str, config_name: str | None = None, **kwargs: Any):
    from marl_llm.extras import require

    require("metrics", "the evaluate metric modules")
    import evaluate

    return evaluate.load(path(name), config_name, **kwargs)
