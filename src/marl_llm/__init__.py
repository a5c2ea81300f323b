"""marl-llm: train cooperating LLM agents with multi-agent reinforcement learning.

From Python (marl_llm/api.py): `train_team(rows, prompts=..., reward=..., agents=[...])` trains a team
on your own data and joint reward, `train(cfg)` any config (`compose_config([...overrides])`). Your
own tasks, algorithms, baselines and losses: docs/extending.md.
"""

from typing import Any

from marl_llm.version import __version__

__all__ = ["TrainResult", "compose_config", "train", "train_team", "__version__"]


def __getattr__(name: str) -> Any:
    # Imported on first use, so that `import marl_llm.<module>` stays light (no Hydra, no torch).
    if name in ("TrainResult", "train", "train_team"):
        from marl_llm import api

        return getattr(api, name)
    if name == "compose_config":
        from marl_llm.configure import compose_config

        return compose_config
    raise AttributeError(f"module 'marl_llm' has no attribute {name!r}")
