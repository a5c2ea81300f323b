"""What a run would refuse once it builds its task and loads its models, checked before the console
script imports the trainer (torch, transformers, dynamo: ~5 s of CPU).

`configure.validate` checks the config's values; these checks run the user's code and look at the
disk: task=env's environment (imported, constructed and tried dry: tasks/env.py), then every base
model's source (models/sources.py). The trainer builds the same task and loads the same models
again, so a wrong setting stops the run with the same line, only seconds sooner; an environment's
dry run thus runs twice per command.
"""

from __future__ import annotations

from typing import Any

from marl_llm.models.sources import check_sources

# The tasks whose building runs the user's code and reads no data (task=env: the environment's
# class, its constructor and the dry run), built here once.
BUILT_BEFORE_THE_TRAINER = ("env",)


def preflight(cfg: Any) -> None:
    """Raise the UserError that building the task or loading a base model would raise at once."""
    if cfg.task.name in BUILT_BEFORE_THE_TRAINER:
        from marl_llm.tasks import build_task

        build_task(cfg.task)
    check_sources(cfg.model)
